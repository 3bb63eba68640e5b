"""What a run prints. By default the console shows the progress bar, medray's own lines (one per stage or event) and
errors from anyone; everything else (third-party warnings, Ray's start-up lines, every actor's stdout and stderr) goes
to output_dir/run.log only. `logging.verbose=true` prints all of it on the console as well.
"""
from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

from cluster.ray_session import QUIET_ENV

#: An actor's output lines that reach a quiet console: errors and tracebacks (the rest is in run.log).
ERROR_LINE = re.compile(r"traceback|error\b|exception\b|critical|out of memory", re.IGNORECASE)
FILE_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class BarSafeHandler(logging.StreamHandler):
    """Writes above a running tqdm bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001  (logging must never raise into the run)
            self.handleError(record)


class ConsoleFilter(logging.Filter):
    """Quiet console: medray's records at INFO and above, everyone else's at ERROR and above."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.startswith("medray") or record.levelno >= logging.ERROR


def configure(out: Path, verbose: bool) -> Path:
    """Send the driver's logging to the console and to `out`/run.log, and (quiet) set the environment the actors inherit
    so vLLM, transformers and OpenMP print errors only and no per-item progress bar. Call before Ray starts.
    Returns run.log's path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "run.log"
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(logging.INFO)
    to_file = logging.FileHandler(path, encoding="utf-8")
    to_file.setFormatter(logging.Formatter(FILE_FORMAT))
    to_console = BarSafeHandler()
    if verbose:
        to_console.setFormatter(logging.Formatter(FILE_FORMAT))
    else:
        to_console.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        to_console.addFilter(ConsoleFilter())
        for key, value in QUIET_ENV.items():
            os.environ.setdefault(key, value)
    root.addHandler(to_file)
    root.addHandler(to_console)
    logging.captureWarnings(True)  # Python warnings (deprecations and the like) are records of "py.warnings"
    import ray  # noqa: F401  (Ray gives its logger a console handler on import; routed through the root instead)
    ray_logger = logging.getLogger("ray")
    ray_logger.handlers.clear()
    ray_logger.propagate = True
    return path


def route_actor_output(path: Path) -> None:
    """Quiet, after ray.init: every actor's stdout and stderr lines go to run.log, and those with an error or a
    traceback to the console too. Replaces the printer Ray installs for `log_to_driver`."""
    from ray._private import worker as ray_worker
    from tqdm import tqdm

    log_file = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115  (open for the driver's lifetime)

    def handle(data: dict) -> None:
        lines = [f"({data.get('actor_name') or data.get('task_name') or 'worker'} pid={data.get('pid')}) {line}"
                 for line in data.get("lines", [])]
        if lines:
            log_file.write("\n".join(lines) + "\n")
        if data.get("is_err") and any(ERROR_LINE.search(line) for line in lines):
            tqdm.write("\n".join(lines), file=sys.stderr)

    dispatcher = ray_worker.global_worker_stdstream_dispatcher
    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("medray_actor_output", handle)
