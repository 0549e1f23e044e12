"""ColdSnap's stand-in for ansible-test's pip bootstrap script, for hosts that cannot reach
the script's download site. ansible-test runs it inside a fresh virtualenv with the
arguments of ``pip install`` (e.g. ``--disable-pip-version-check pip==24.2 --no-setuptools``).

It bootstraps pip from the interpreter's own ``ensurepip`` (no download), then installs the
requested pip with it: from the wheels that scripts/ansible-sanity.sh saved beside this file
(``pip-wheels/``), else from the configured package index.
"""

import ensurepip
import os
import subprocess
import sys

ensurepip.bootstrap(upgrade=False)
args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
wheels = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pip-wheels")
if os.path.isdir(wheels):
    args = ["--no-index", "--find-links", wheels, *args]
sys.exit(subprocess.call([sys.executable, "-m", "pip", "install", *args]))
