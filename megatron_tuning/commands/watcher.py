"""A job's watcher: a launcher's child that outlives it, to clean up after it (``job.job_group``).

Run by path (``python -I -S watcher.py group|- FOLDER...``) and importing only the standard library,
so it starts in a few milliseconds beside every job a launcher runs.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def watch(kill_group: bool, folders: list[str]) -> None:
    """Wait until stdin closes, which the kernel does when the launcher dies (SIGKILL included), then
    kill this process's group where ``kill_group`` (the job's, which it leads, so the id cannot be
    reused while it runs) and remove ``folders``. A launcher that ends well kills it first."""
    for name in ("SIGINT", "SIGQUIT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)  # a launcher passes them to its group
    while os.read(0, 4096):
        pass
    group = os.getpgrp() if kill_group else None
    if group is not None and os.fork():  # this process keeps the group alive until the kill
        os.wait()
        os._exit(0)
    if group is not None:  # the child, in a group of its own: the kill spares it for the clean-up
        os.setpgid(0, 0)
        os.killpg(group, signal.SIGKILL)
    import shutil

    # Again while the group lasts (a member, a zombie too, keeps it): a process killed in a system
    # call ends that call first, which may have made a file.
    end = time.monotonic() + 2.0
    while True:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        if group is None or time.monotonic() > end:
            return
        try:
            os.killpg(group, 0)
        except OSError:
            return
        time.sleep(0.05)


if __name__ == "__main__":
    watch(sys.argv[1] == "group", sys.argv[2:])
