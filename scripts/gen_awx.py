"""Write (or --check) docs/awx/*.json from the AWX config-as-code in docs/awx/controller/.

The YAML files (infra.controller_configuration's variable format) are the one source: the
survey JSON that ``POST /api/v2/job_templates/<id>/survey_spec/`` takes and the credential
type JSON that the AWX API or UI takes are derived from them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

AWX = Path(__file__).resolve().parents[1] / "docs" / "awx"
CONTROLLER = AWX / "controller"
# output file -> (YAML file, list variable, name of the entry, key of the entry to write, or None for all of it)
OUTPUTS = {
    "survey.json": ("job_templates.yml", "controller_templates", "ColdSnap restore", "survey_spec"),
    "credential-type-registry.json": ("credential_types.yml", "controller_credential_types",
                                      "ColdSnap capsule registry", None),
    "credential-type-huggingface.json": ("credential_types.yml", "controller_credential_types",
                                         "ColdSnap Hugging Face", None),
}


class _Loader(yaml.SafeLoader):
    """Safe loading that reads Ansible's ``!unsafe`` tag as the plain string it marks."""


_Loader.add_constructor("!unsafe", lambda loader, node: loader.construct_scalar(node))


def derived() -> dict[str, str]:
    """Every output file's expected text."""
    out = {}
    for name, (source, variable, entry, key) in OUTPUTS.items():
        data = yaml.load((CONTROLLER / source).read_text(), Loader=_Loader)
        matches = [item for item in data[variable] if item["name"] == entry]
        if len(matches) != 1:
            raise SystemExit(f"{source}: expected one {variable} entry named {entry!r}, found {len(matches)}")
        value = matches[0][key] if key else matches[0]
        out[name] = json.dumps(value, indent=2, ensure_ascii=False) + "\n"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when a JSON file differs from its YAML source")
    args = parser.parse_args(argv)
    stale = []
    for name, text in derived().items():
        path = AWX / name
        if path.exists() and path.read_text() == text:
            continue
        if args.check:
            stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}", file=sys.stderr)
    if stale:
        print(f"docs/awx: {', '.join(stale)} out of date with docs/awx/controller/; run python scripts/gen_awx.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
