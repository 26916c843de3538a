"""``python -m protocol``: inspect captured payloads, or run the wire demo.

Commands:
    inspect FILE|- [FILE ...]   decode a captured payload (e.g. from
                                ``mosquitto_sub -C 1 -N``) and print a JSON summary;
                                several files: the chunks of one transfer.
                                ``--values`` adds each tensor's values (dequantized).
    demo                        send a model at every precision through an embedded
                                MQTT broker and print what each costs on the wire.
    keys ID [ID ...] --keyring FILE --out DIR
                                give each device a new 32-byte message key: DIR/ID.key
                                for the device (--auth-key-file), the same in the
                                coordinator's keyring FILE (--device-keys), both 0600;
                                ``python -m deploy device`` does this within its kit.
    keys --new-fleet-token FILE a new 32-byte fleet token (0600) for enrolment: the
                                coordinator's --fleet-token-file, and the devices'
                                (--fleet-token-file) or, better, their derived keys:
    keys ID [ID ...] --fleet-token FILE --out DIR
                                DIR/ID.key holds the key derived from the token for ID
                                (--auth-key-file); the coordinator enrols it on first
                                contact (docs/protocol.md, section 2.4).
    keys --new-signing-key FILE the coordinator's Ed25519 signing key (0600) and its
                                public key FILE.pub: the coordinator's
                                --signing-key-file, the devices' --coordinator-key-file
                                (docs/protocol.md, section 2.5).

Exit codes: 0 success, 2 bad input or usage (one line on stderr), 3 broker failure.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from protocol.errors import DecodeError, TransportError

EXIT_BAD_INPUT = 2
EXIT_BROKER = 3


def _read(name: str) -> bytes:
    if name == "-":
        return sys.stdin.buffer.read()
    return Path(name).read_bytes()


def _inspect(args: argparse.Namespace) -> int:
    from protocol.inspect import summarize

    try:
        payloads = [_read(name) for name in args.files]
        names = ["stdin" if name == "-" else name for name in args.files]
        summary = summarize(payloads, values=args.values, names=names)
    except OSError as exc:
        print(f"error: cannot read input: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except DecodeError as exc:
        print(f"error: not a valid payload: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    json.dump(summary, sys.stdout, indent=None if args.compact else 2)
    sys.stdout.write("\n")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from protocol.demo import run_demo

    try:
        rows = run_demo(model=args.model, level=args.level, max_payload=args.max_payload)
    except TransportError as exc:
        print(f"error: broker: {exc}", file=sys.stderr)
        return EXIT_BROKER
    if args.json:
        print(json.dumps(rows))
        return 0
    header = (
        f"{'precision':<10}{'payload B':>11}{'wire B':>9}{'chunks':>8}"
        f"{'vs fp32':>9}{'max |err|':>11}{'ms':>7}"
    )
    print(f"model {args.model}: one model message through an embedded MQTT broker")
    print(header)
    for r in rows:
        print(
            f"{r['precision']:<10}{r['payload_bytes']:>11}{r['wire_bytes']:>9}{r['chunks']:>8}"
            f"{r['ratio_vs_fp32']:>8.2f}x{r['max_abs_error']:>11.2e}{r['round_trip_ms']:>7.1f}"
        )
    return 0


def _keys(args: argparse.Namespace) -> int:
    from protocol.auth import Keyring, new_key, write_key_file
    from protocol.topics import valid_identifier

    if args.new_signing_key is not None:
        return _new_signing_key(args)
    if args.new_fleet_token is not None:
        return _new_fleet_token(args)
    if not args.devices or args.out is None or (args.keyring is None) == (args.fleet_token is None):
        print(
            "error: give ID ... --out DIR with --keyring FILE (new keys) or --fleet-token FILE "
            "(derived keys), or --new-fleet-token FILE",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    bad = [d for d in args.devices if not valid_identifier(d)]
    if bad:
        print(f"error: invalid device id(s): {', '.join(bad)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.fleet_token is not None:
        return _derived_keys(args)
    try:
        keyring = Keyring.load(args.keyring) if args.keyring.exists() else Keyring()
        args.out.mkdir(parents=True, exist_ok=True)
        for device_id in args.devices:
            key = new_key()
            write_key_file(args.out / f"{device_id}.key", key)
            keyring = keyring.with_key(device_id, key)
        keyring.save(args.keyring)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"{len(args.devices)} key(s) in {args.out}; keyring {args.keyring}: {len(keyring)}")
    return 0


def _new_fleet_token(args: argparse.Namespace) -> int:
    from protocol.auth import new_key, write_fleet_token

    if args.devices or args.keyring is not None or args.fleet_token is not None:
        print(
            "error: --new-fleet-token takes no device ids, --keyring or --fleet-token",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    if args.new_fleet_token.exists() and not args.force:
        print(
            f"error: {args.new_fleet_token} exists (replacing a fleet token changes every "
            "derived key; --force to do it)",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    try:
        write_fleet_token(args.new_fleet_token, new_key())
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"new fleet token in {args.new_fleet_token} (mode 0600): keep it secret")
    return 0


def _new_signing_key(args: argparse.Namespace) -> int:
    from protocol.signing import SigningKey, public_key_path

    path = args.new_signing_key
    if args.devices or args.keyring or args.fleet_token or args.new_fleet_token or args.out:
        print("error: --new-signing-key takes no other option but --force", file=sys.stderr)
        return EXIT_BAD_INPUT
    if path.exists() and not args.force:
        print(
            f"error: {path} exists (a new signing key must reach every device before the "
            "coordinator uses it; --force to replace it)",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    key = SigningKey.generate()
    try:
        key.save(path)
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(
        f"signing key in {path} (mode 0600, the coordinator's --signing-key-file), public "
        f"key {key.verify_key.fingerprint}... in {public_key_path(path)} (every device's "
        "--coordinator-key-file)"
    )
    return 0


def _derived_keys(args: argparse.Namespace) -> int:
    from protocol.auth import derive_device_key, read_fleet_token, write_key_file

    try:
        token = read_fleet_token(args.fleet_token)
        args.out.mkdir(parents=True, exist_ok=True)
        for device_id in args.devices:
            write_key_file(args.out / f"{device_id}.key", derive_device_key(token, device_id))
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(
        f"{len(args.devices)} derived key(s) in {args.out}: the coordinator with the fleet "
        "token enrols each device on first contact"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m protocol", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("inspect", help="decode a captured payload and print a JSON summary")
    p.add_argument("files", nargs="+", metavar="FILE|-", help="payload file(s), - for stdin")
    p.add_argument("--compact", action="store_true", help="one-line JSON")
    p.add_argument(
        "--values",
        action="store_true",
        help="also print every tensor's values (dequantized where quantized) as JSON lists",
    )
    p.set_defaults(run=_inspect)
    d = sub.add_parser("demo", help="send a model at each precision via an embedded broker")
    d.add_argument("--model", default="lenet5", choices=["lenet5", "resnet8", "resnet8_small"])
    d.add_argument("--level", type=int, default=3, choices=[1, 2, 3], help="zstd level")
    d.add_argument("--max-payload", type=int, default=128 * 1024, help="chunk size in bytes")
    d.add_argument("--json", action="store_true", help="print one JSON array")
    d.set_defaults(run=_demo)
    k = sub.add_parser(
        "keys", help="device keys, the coordinator's keyring and signing key, fleet tokens"
    )
    k.add_argument("devices", nargs="*", metavar="ID", help="device ids")
    k.add_argument("--keyring", type=Path, help="coordinator's keyring (JSON) to add new keys to")
    k.add_argument("--out", type=Path, help="folder of the devices' key files")
    k.add_argument(
        "--fleet-token",
        type=Path,
        metavar="FILE",
        help="derive each device's key from this fleet token instead (no keyring: the "
        "coordinator run with --fleet-token-file enrols the devices)",
    )
    k.add_argument(
        "--new-fleet-token", type=Path, metavar="FILE", help="write a new fleet token (0600)"
    )
    k.add_argument(
        "--new-signing-key",
        type=Path,
        metavar="FILE",
        help="write the coordinator's signing key (0600) and FILE.pub for the devices",
    )
    k.add_argument(
        "--force", action="store_true", help="replace an existing fleet token or signing key"
    )
    k.set_defaults(run=_keys)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_BAD_INPUT
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.run(args))
    except BrokenPipeError:  # e.g. piped into `head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
