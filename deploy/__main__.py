"""Command line of the deployment kit: ``python -m deploy <command> ...`` (docs/deploy.md).

Commands:
    init       make a fleet's kit in ``--out`` (default ``edgefl-kit``): a lab CA (EC
               P-256, ten years), the broker's server certificate (a SAN per ``--host``),
               the coordinator's client certificate and / or password, and the broker's
               ``mosquitto.conf`` and ``acl``::

                   python -m deploy init --fleet lab --host broker.lan --host 10.0.0.2

    device     issue a key and client certificate (CN = the device id) to each device
    passwords  give each device a random password (its file, and its hash in the broker's
               password file) instead
               (both: ``--fleet-token FILE`` derives each device's message key from the
               fleet token and leaves it out of the coordinator's keyring, for enrolment)

Nothing that would invalidate credentials (a CA, a certificate, a password) is replaced
without ``--force``. Every file written is listed on stdout, relative to ``--out``;
secrets are never printed.

Exit codes:
    0   success
    1   a file could not be written or read (the operating system's error)
    2   usage error: a bad name, host or option, a credential that exists, no kit, or the
        ``cryptography`` library missing (install ``edgefl[deploy]``); one line on stderr
"""

from __future__ import annotations

import argparse
import logging
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deploy.errors import KitError, KitUsageError
from deploy.settings import KitSettings, make_settings
from protocol.auth import read_fleet_token

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
DEFAULT_OUT = Path("edgefl-kit")


def _default(field: str) -> str:
    """The default of a :class:`KitSettings` field, for a flag's help."""
    value = KitSettings.model_fields[field].default
    return " and ".join(value) if isinstance(value, tuple) else str(value)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m deploy",
        description="Credentials, Mosquitto configuration and ACL of one edgefl fleet.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    out = argparse.ArgumentParser(add_help=False)
    out.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        metavar="DIR",
        help="the kit folder (default %(default)s)",
    )
    out.add_argument("--force", action="store_true", help="replace existing credentials")

    init = commands.add_parser(
        "init",
        parents=[out],
        help="make the CA, broker certificate and configuration, coordinator credentials",
        description="Make a fleet's kit; --force replaces an existing one (every device "
        "must then be issued credentials again).",
    )
    init.add_argument("--fleet", required=True, help="fleet name: the topic tree fl/FLEET/")
    init.add_argument(
        "--host",
        action="append",
        dest="hosts",
        metavar="NAME|IP",
        help="a name or address clients reach the broker by, repeated for each "
        f"(default: {_default('hosts')})",
    )
    init.add_argument(
        "--coordinator-id",
        help=f"the coordinator's account name (default {_default('coordinator_id')})",
    )
    init.add_argument(
        "--auth",
        choices=typing.get_args(KitSettings.model_fields["auth"].annotation),
        help="client certificates, passwords, or both on two listeners "
        f"(default {_default('auth')})",
    )
    init.add_argument(
        "--port", type=int, help=f"the first listener's port (default {_default('port')})"
    )
    init.add_argument(
        "--password-port",
        type=int,
        help="with --auth both: the password listener's port (default: --port + 1)",
    )
    init.add_argument("--bind", help="address the listeners bind to (default: all)")
    init.add_argument(
        "--broker-dir",
        type=Path,
        metavar="DIR",
        help="absolute folder the broker host keeps the kit's broker/ files in, named in "
        "mosquitto.conf (default: the kit's broker/ folder here)",
    )
    init.add_argument(
        "--days",
        type=int,
        help=f"validity of the certificates issued (default {_default('days')})",
    )

    for name, text in (
        ("device", "issue a key and client certificate (CN = device id) to each device"),
        ("passwords", "give each device a random password for the password listener"),
    ):
        command = commands.add_parser(name, parents=[out], help=text, description=text)
        command.add_argument("device_ids", nargs="+", metavar="ID", help="device id")
        command.add_argument(
            "--fleet-token",
            type=Path,
            metavar="FILE",
            help="derive the message keys from this fleet token (python -m protocol keys "
            "--new-fleet-token) and leave the devices out of the coordinator's keyring: "
            "the coordinator run with --fleet-token-file enrols them",
        )
    return parser


def _init_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The kit settings given on the command line (the model's defaults fill the rest)."""
    given = {
        "fleet": args.fleet,
        "hosts": args.hosts,
        "coordinator_id": args.coordinator_id,
        "auth": args.auth,
        "port": args.port,
        "password_port": args.password_port,
        "bind": args.bind,
        "days": args.days,
    }
    settings = {key: value for key, value in given.items() if value is not None}
    settings["broker_dir"] = str(args.broker_dir or (args.out / "broker").resolve())
    return settings


def _run(args: argparse.Namespace) -> list[Path]:
    from deploy import kit

    layout = kit.KitLayout(args.out)
    if args.command == "init":
        settings = make_settings(**_init_settings(args))
        return kit.init_kit(layout, settings, force=args.force)
    token = None
    if args.fleet_token is not None:
        try:
            token = read_fleet_token(args.fleet_token)
        except ValueError as exc:
            raise KitUsageError(str(exc)) from exc
    if args.command == "device":
        return kit.issue_devices(layout, args.device_ids, force=args.force, fleet_token=token)
    return kit.issue_passwords(layout, args.device_ids, force=args.force, fleet_token=token)


_NEXT = {
    "init": "next: `python -m deploy device ID ...` (or `passwords`), then start Mosquitto "
    "with broker/mosquitto.conf (docs/deploy.md)",
    "device": "the broker needs no change: it trusts every certificate of the kit's CA",
    "passwords": "copy broker/passwords to the broker and send Mosquitto a SIGHUP to load it",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    try:
        written = _run(args)
    except ModuleNotFoundError as exc:
        if exc.name != "cryptography":
            raise
        print(
            "error: the deployment kit needs the cryptography library: "
            "pip install 'edgefl[deploy]'",
            file=sys.stderr,
        )
        return EXIT_USAGE
    except KitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    for path in dict.fromkeys(written):  # a CA copy may be written twice
        print(path.relative_to(args.out) if path.is_relative_to(args.out) else path)
    print(_NEXT[args.command], file=sys.stderr)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
