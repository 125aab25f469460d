"""Check that the built book renders its math offline: `python scripts/check_book_math.py`.

Opens each built page that contains math in headless Chromium with every host name unresolvable, and
checks that MathJax (served from the book's own _static/mathjax/) typeset all of it without errors
and that no page loads a script or style sheet from another host. Run it after `make book`; it is not
part of `make test`. Without a Chromium binary it prints why and exits 0 (use --require to fail).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
MATH_SOURCE = re.compile(r'<(?:span|div) class="math notranslate nohighlight"')
REMOTE_ASSET = re.compile(r'<(?:script[^>]*\ssrc|link[^>]*\shref)="(?:https?:)?//[^"]*"')
MATHJAX_SRC = re.compile(r'<script[^>]*\ssrc="([^"]*tex-chtml\.js[^"]*)"')


def chromium_args(binary: str, profile: str) -> list[str]:
    """Headless Chromium that cannot reach the network: every host name fails to resolve."""
    return [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
            "--host-resolver-rules=MAP * ~NOTFOUND", "--virtual-time-budget=10000"]


def check_page(binary: str, page: Path, label: str, screenshot: Path | None) -> list[str]:
    """Problems found on one page (empty when its math rendered)."""
    html = page.read_text(encoding="utf-8")
    problems = [f"loads a remote asset: {m.group(0)}" for m in REMOTE_ASSET.finditer(html)]
    src = MATHJAX_SRC.search(html)
    if not src:
        problems.append("no local MathJax <script> (tex-chtml.js)")
    elif not (page.parent / src.group(1).split("?")[0]).is_file():
        problems.append(f"MathJax script {src.group(1)} is missing from the build")
    expected = len(MATH_SOURCE.findall(html))
    with tempfile.TemporaryDirectory() as profile:
        args = chromium_args(binary, profile)
        dom = subprocess.run(args + ["--dump-dom", page.as_uri()], capture_output=True, text=True,
                             timeout=180).stdout
        if screenshot is not None:
            subprocess.run(args + ["--window-size=1280,2400", f"--screenshot={screenshot}", page.as_uri()],
                           capture_output=True, timeout=180)
    rendered = dom.count("<mjx-container")
    errors = len(re.findall(r"<mjx-merror|data-mjx-error", dom))
    if rendered < expected:
        problems.append(f"MathJax typeset {rendered} of {expected} math elements")
    if errors:
        problems.append(f"{errors} MathJax error(s) in the rendered page")
    print(f"{'ok  ' if not problems else 'FAIL'} {label}: {rendered} mjx-container for {expected} math elements, "
          f"{errors} MathJax errors")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build", nargs="?", default=str(ROOT / "_build" / "html"), help="built HTML folder")
    parser.add_argument("--screenshots", metavar="DIR", help="also save a PNG of each checked page here")
    parser.add_argument("--require", action="store_true", help="fail, not skip, when Chromium is absent")
    args = parser.parse_args(argv)

    binary = next((b for b in map(shutil.which, BROWSERS) if b), None)
    if binary is None:
        print("SKIP: no Chromium found (on Debian: apt-get install chromium)")
        return 1 if args.require else 0
    build = Path(args.build).resolve()
    pages = sorted(p for p in build.rglob("*.html")
                   if not p.relative_to(build).parts[0].startswith("_") and MATH_SOURCE.search(p.read_text("utf-8")))
    if not pages:
        print(f"FAIL: no built page with math under {build} (run `make book` first)")
        return 1
    shots = Path(args.screenshots) if args.screenshots else None
    if shots:
        shots.mkdir(parents=True, exist_ok=True)
    failures = 0
    for page in pages:
        label = page.relative_to(build).as_posix()
        shot = shots / (label.replace("/", "_") + ".png") if shots else None
        for problem in check_page(binary, page, label, shot):
            print(f"     {problem}")
            failures += 1
    print(f"{len(pages)} page(s) with math checked, {failures} problem(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
