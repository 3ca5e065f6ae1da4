"""``tokentrail mint-credentials DIR``: the role secrets of a deployment, one file each.

What ``tokentrail run`` does for itself, for an operator starting the processes one by
one: every verb that serves or calls a guarded route then takes ``--credentials-dir DIR``
(DESIGN §15). Secrets already in DIR are kept, so minting again is safe; none is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pipeline.auth.credentials import AGENT_KEY_FILE, ROLE_FILES, CredentialError, Credentials

EXAMPLE = """\
example:
  tokentrail mint-credentials tt-cluster/credentials
  tokentrail worker --model DIR --bootstrap KAFKA --credentials-dir tt-cluster/credentials
"""


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "mint-credentials",
        help="write the operator, environment, service and client secrets and the agent key into DIR",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("dir", type=Path, metavar="DIR", help="the directory (created 0700; files 0600)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        credentials = Credentials.mint(args.dir)
    except (CredentialError, OSError) as exc:
        print(f"tokentrail mint-credentials: {exc}", file=sys.stderr)
        return 2
    files = [ROLE_FILES[role] for role in credentials.tokens] + [AGENT_KEY_FILE]
    print(json.dumps({"dir": str(args.dir), "files": sorted(files)}))
    return 0
