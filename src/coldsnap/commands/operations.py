"""``coldsnap capture|restore|warm|publish|publish-native|sleep|wake|status|native-status|delete|stop``.

Every operation verb does the same, through :mod:`coldsnap.api`: validate the
request strictly (before any host is touched), run the collection's
``playbooks/<operation>.yml`` through ansible-runner, and write receipt format 2.
When stdout is a terminal it gets a short summary for people; with ``--json``, or
when stdout is piped, it carries the receipt JSON (or, with ``--receipt-json``,
nothing but what ``--timing-ndjson -`` streams); progress and the one-line summary
go to stderr. Exit status: 0 succeeded, 1 failed, 130 cancelled (SIGINT/SIGTERM/SIGHUP),
2 for a request or usage error.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import (
    require_not_planted_output,
    write_output,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import OPERATIONS

from coldsnap import api
from coldsnap.commands._io import print_json, wants_json
from coldsnap.receipts import receipt_bytes
from coldsnap.runner import PREPARE_ONLY_OPERATIONS
from coldsnap.summary import format_summary

STATE_ROOT_HELP = ("state directory (default: $COLDSNAP_STATE_ROOT, /var/lib/coldsnap for root, "
                   "$XDG_STATE_HOME/coldsnap otherwise)")


def register(sub) -> None:
    for verb in OPERATIONS:
        summary = api.SUMMARIES[verb]
        p = sub.add_parser(verb, help=summary,
                           description=f"{summary}. Runs playbooks/{verb.replace('-', '_')}.yml.")
        p.add_argument("--request-json", metavar="PATH|-", required=True, help="operation request (format 4)")
        p.add_argument("--prepare-only", action="store_true",
                       help="admission, staging and verification only; the running workload is untouched"
                            + ("" if verb in PREPARE_ONLY_OPERATIONS else " (restore and warm only)"))
        p.add_argument("--no-rollback", dest="rollback", action="store_false",
                       help="a restore that fails after evicting the running workload leaves it evicted (by default "
                            "the controller restores what ran before, when it restored that itself)"
                            + ("" if verb in PREPARE_ONLY_OPERATIONS else " (restore and warm only)"))
        p.add_argument("--receipt-json", metavar="PATH", help="write the receipt here instead of stdout")
        p.add_argument("--timing-ndjson", metavar="PATH|-", help="stream timing events (NDJSON) live to a file or stdout")
        p.add_argument("--inventory", metavar="PATH", help="Ansible inventory (default: built from the request)")
        p.add_argument("--state-root", metavar="PATH", help=STATE_ROOT_HELP)
        p.add_argument("--json", action="store_true",
                       help="print the receipt JSON on stdout even on a terminal (the default when stdout is "
                            "piped); without it a terminal gets a short summary")
        p.add_argument("-e", "--extra-var", dest="extra_vars", action="append", default=[], metavar="KEY=VALUE",
                       help="extra variable for the playbook (a string; secret-looking names travel as secrets, "
                            "but a credential belongs in --secret-env: a command line is visible to every user)")
        p.add_argument("--secret-env", action="append", default=[], metavar="KEY=ENVVAR",
                       help="pass the value of environment variable ENVVAR as secret extra var KEY")
        p.add_argument("--playbook", metavar="PATH|FQCN",
                       help="run this playbook instead of the collection's (custom or test playbooks)")
        p.add_argument("-v", "--verbose", action="count", default=0,
                       help="ansible-playbook verbosity (-v .. -vvvv); its output, scrubbed of known secrets, "
                            "is kept in the run's artifacts/<ident>/stdout (the path is printed at the end)")
        out = p.add_mutually_exclusive_group()
        out.add_argument("--quiet", action="store_true", help="no progress and no summary on stderr")
        out.add_argument("--progress", action="store_true", help="show progress even when stderr is not a terminal")
        p.set_defaults(func=run, operation=verb)


def _key_values(items: list[str], option: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        form = "KEY=ENVVAR" if option == "--secret-env" else "KEY=VALUE"
        if not sep:
            raise ColdSnapError(f"{option} {item!r} is not {form}", fix=f"write it as {option} {form}")
        if not key.isidentifier():
            raise ColdSnapError(f"{option} {item!r}: {key!r} is not a variable name",
                                fix="use letters, digits and '_' (not starting with a digit)")
        if key in out:
            raise ColdSnapError(f"{option} {key} is given twice", fix="give each variable once")
        out[key] = value
    return out


@contextmanager
def cancel_on_signals() -> Iterator[threading.Event]:
    """SIGINT, SIGTERM and SIGHUP set the returned event (the run stops and still writes its receipt).

    SIGHUP is a cancel too: a terminal or SSH session that closes under a running ``coldsnap`` would otherwise
    end the controller at once, leaving its playbook holding the workload and no receipt behind."""
    event = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield event
        return
    previous = {}

    def handler(signum, frame) -> None:
        event.set()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        previous[sig] = signal.signal(sig, handler)
    try:
        yield event
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def run(args) -> int:
    extra = _key_values(args.extra_vars, "-e")
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.secrets import is_credential_name

    for key in extra:
        if is_credential_name(key) and not args.quiet:
            # It travels as a secret from here on, but a command line is readable by every user of this host.
            print(f"coldsnap: warning: -e {key}=... puts a credential on the command line, which every user of "
                  f"this host can read in the process list; use --secret-env {key}=ENVVAR", file=sys.stderr)
    secrets: dict[str, str] = {}
    for key, env_name in _key_values(args.secret_env, "--secret-env").items():
        if key in extra:
            raise ColdSnapError(f"{key} is given both by -e and by --secret-env", fix="give it once")
        if env_name not in os.environ:
            raise ColdSnapError(f"--secret-env {key}={env_name}: environment variable {env_name} is not set",
                                fix=f"export {env_name} first")
        secrets[key] = os.environ[env_name]
    for env_name in set(_key_values(args.secret_env, "--secret-env").values()):
        # Read, then out of this process's environment: ansible-runner hands its environment to
        # ansible-playbook, and on a local connection to every module and what they start.
        os.environ.pop(env_name, None)
    progress = False if args.quiet else (True if args.progress else None)
    if not args.rollback and args.operation not in PREPARE_ONLY_OPERATIONS:
        raise ColdSnapError(f"--no-rollback does not apply to operation {args.operation!r}: it evicts nothing",
                            fix=f"use it with {' or '.join(PREPARE_ONLY_OPERATIONS)}, or leave it out")
    for flag, output in (("--receipt-json", args.receipt_json), ("--timing-ndjson", args.timing_ndjson)):
        if output and output != "-":
            _check_not_the_request(Path(output), args.request_json, flag)
    if args.receipt_json:
        _check_output_file(Path(args.receipt_json), "--receipt-json")  # before the operation, not after it ran
    if args.timing_ndjson and args.timing_ndjson != "-":
        _check_output_file(Path(args.timing_ndjson), "--timing-ndjson")  # before a run directory is made

    with cancel_on_signals() as cancel:
        receipt = api.run(args.operation, args.request_json, prepare_only=args.prepare_only,
                          inventory=args.inventory, state_root=args.state_root, extravars=extra, secrets=secrets,
                          playbook=args.playbook, timing_sink=args.timing_ndjson, progress=progress,
                          cancel_event=cancel, verbosity=args.verbose, rollback=args.rollback)
    code = receipt.exit_code
    receipt_file = args.receipt_json
    if receipt_file:
        try:
            write_output(receipt_file, receipt_bytes(receipt.raw))
        except OSError as exc:  # it changed since the check above: the operation's outcome still counts
            print(f"coldsnap: cannot write --receipt-json {receipt_file} ({exc.strerror or exc}); the receipt is "
                  f"at {receipt.path}", file=sys.stderr)
            receipt_file, code = None, code or 1
    human = args.timing_ndjson != "-" and not wants_json(args)
    try:
        if human:
            # A person at a terminal: the summary instead of 10-60 KB of JSON (the receipt is on disk).
            print(format_summary(receipt.raw, receipt_path=receipt_file or receipt.path))
        elif receipt_file or args.timing_ndjson == "-":
            pass  # stdout carries nothing, or the NDJSON stream; the receipt is in the file / the run directory
        else:
            print_json(receipt.raw)
        sys.stdout.flush()
    except BrokenPipeError:
        # stdout closed early (piped into head): the outcome still goes to stderr and the exit status.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        human = False
    if not args.quiet and not human:
        if receipt_file:
            where = receipt_file
        else:  # the NDJSON stream on stdout, or a --receipt-json that could not be written: the run's copy
            where = str(receipt.path) if args.timing_ndjson == "-" or args.receipt_json else "stdout"
        line = f"coldsnap {args.operation}: {receipt.state}{' (cancelled)' if receipt.cancelled else ''}"
        if receipt.error:
            line += f": {receipt.error.message}"
        print(f"{line}\nreceipt: {where}", file=sys.stderr)
    gone = (receipt.raw.get("result") or {}).get("artifact_gone")
    if gone and not args.quiet:
        print(f"coldsnap: note: artifact {gone} is gone (deleted?); {args.operation} acted on the running workload "
              "without it", file=sys.stderr)
    ident = ((receipt.raw.get("result") or {}).get("runner") or {}).get("ident")
    if args.verbose and not args.quiet and ident:
        # ansible-playbook's own output (as verbose as asked) is kept with the run, not mixed into the progress
        print(f"ansible-playbook output (-{'v' * args.verbose}): {Path(receipt.path).parent / 'artifacts' / ident / 'stdout'}",
              file=sys.stderr)
    return code


def _check_not_the_request(output: Path, request: str | None, flag: str) -> None:
    """An output that is the request file itself would replace the request with the receipt or the stream."""
    if not request or request == "-":
        return
    with contextlib.suppress(OSError):
        if os.path.samefile(output, request):
            raise ColdSnapError(f"{flag} {output} is the request file {request}: the run would overwrite it",
                                fix=f"give {flag} another path")


def _check_output_file(path: Path, flag: str) -> None:
    """A file the command will write: not a directory, in a directory this user may write (or a device, FIFO
    or socket this user may write to, such as /dev/stdout: written to, never replaced)."""
    with contextlib.suppress(OSError):
        if not stat.S_ISREG(mode := os.stat(path).st_mode) and not stat.S_ISDIR(mode) and os.access(path, os.W_OK):
            require_not_planted_output(path)
            return
    if path.is_dir():
        raise ColdSnapError(f"{flag} {path} is a directory", fix=f"give {flag} a file name (e.g. {path}/receipt.json)")
    parent = path.parent
    if not parent.is_dir():
        raise ColdSnapError(f"{flag} {path}: directory {parent} does not exist", fix="create it, or give another path")
    if not os.access(parent, os.W_OK | os.X_OK) or parent.resolve().parts[1:2] in (("proc",), ("sys",)):
        raise ColdSnapError(f"{flag} {path}: this user cannot create files in {parent}",
                            fix="give a path in a directory you may write")
