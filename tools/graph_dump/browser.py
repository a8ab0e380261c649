"""Headless Chromium from the command line: the rendered DOM, console messages and screenshots.

Only the ``chromium`` binary and the standard library: ``--dump-dom`` prints the
DOM after the page's scripts ran, and ``--enable-logging=stderr`` prints every
console message and uncaught error as an ``INFO:CONSOLE`` line.
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")
_CONSOLE = re.compile(r"CONSOLE[^\]]*\]\s*(.*)")
TIMEOUT_S = 120


def find_chromium() -> str | None:
    explicit = os.environ.get("CHROMIUM")
    if explicit and os.path.exists(explicit):
        return explicit
    for name in _CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class PageLoad:
    dom: str
    console: list[str]       # console messages and uncaught errors, in order


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    chromium = find_chromium()
    if chromium is None:
        raise FileNotFoundError("no chromium found: run scripts/install_browser.sh")
    with tempfile.TemporaryDirectory(prefix="graph_dump_chromium_") as profile:
        flags = ["--headless", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
                 f"--user-data-dir={profile}", "--virtual-time-budget=10000"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            flags.append("--no-sandbox")   # Chromium refuses to run as root with its sandbox
        return subprocess.run([chromium, *flags, *args], capture_output=True, text=True, timeout=timeout,
                              check=False)


def file_url(path: str, fragment: str = "") -> str:
    return pathlib.Path(path).resolve().as_uri() + (f"#{fragment}" if fragment else "")


def load(path: str, fragment: str = "", *, timeout: float = TIMEOUT_S) -> PageLoad:
    """The page's DOM after its scripts ran, and what it wrote to the console."""
    done = _run(["--enable-logging=stderr", "--v=0", "--dump-dom", file_url(path, fragment)], timeout)
    if done.returncode != 0 or "<html" not in done.stdout:
        raise RuntimeError(f"chromium failed on {path} (exit {done.returncode}): {done.stderr[-2000:]}")
    console = [m.group(1) for m in map(_CONSOLE.search, done.stderr.splitlines()) if m]
    return PageLoad(done.stdout, console)


def screenshot(path: str, png: str, *, fragment: str = "", width: int = 1400, height: int = 1600,
               timeout: float = TIMEOUT_S) -> str:
    png = os.path.abspath(png)
    if os.path.exists(png):
        os.remove(png)
    done = _run([f"--window-size={width},{height}", f"--screenshot={png}", file_url(path, fragment)], timeout)
    if done.returncode != 0 or not os.path.exists(png):
        raise RuntimeError(f"chromium made no screenshot of {path} (exit {done.returncode}): {done.stderr[-2000:]}")
    return png
