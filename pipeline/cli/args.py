"""Arguments and logging shared by the job commands (nothing heavy imported: ``satp --help`` comes back at once)."""
from __future__ import annotations


def add_job_arguments(parser, example: str) -> None:
    """The job YAML, ``--set`` overrides, ``--address``, ``--no-progress``."""
    parser.add_argument("job", help="job YAML (jobs/*.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override a job key, e.g. --set {example} (repeatable)")
    parser.add_argument("--address", default=None,
                        help="Ray cluster address, e.g. 10.0.0.5:6379 (default $RAY_ADDRESS, else a new local Ray)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (e.g. in logs)")


def log_to_stderr() -> None:
    """satp's INFO log records on standard error, with their time and logger."""
    import logging
    import sys

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
