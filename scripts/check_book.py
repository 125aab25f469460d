"""Check that the built book renders offline: `python scripts/check_book.py [_build/html]`.

Opens every built page in headless Chromium with every host name unresolvable and checks that MathJax
(served from the book's own _static/mathjax/) typeset all of its math without errors, that every
ipywidgets view was drawn from the notebook's saved state (by the embed manager in
_static/jupyter-widgets/), that every <img> loaded, and that no page loads a script or style sheet
from another host. Run it after `make book`; it is not part of `make test`. Without a Chromium
binary it prints why and exits 0 (use --require to fail).
"""

from __future__ import annotations

import argparse
import html
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
REMOTE_ASSET = re.compile(r'<(?:script[^>]*\ssrc|link[^>]*\shref)="(?:https?:)?//[^"]*"')
LOCAL_SCRIPTS = {"MathJax": re.compile(r'<script[^>]*\ssrc="([^"]*tex-chtml\.js[^"]*)"'),
                 "widget manager": re.compile(r'<script[^>]*\ssrc="([^"]*jupyter-widgets/embed\.js[^"]*)"')}
WIDGET_VIEW = '<script type="application/vnd.jupyter.widget-view+json">'

# Runs in the page once it has loaded: waits for MathJax, gives the widget manager a moment, then
# writes what rendered into an attribute of <body> for --dump-dom to carry out.
PROBE = """<script>
window.addEventListener("load", async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;
  await new Promise(r => setTimeout(r, 3000));
  const q = s => Array.from(document.querySelectorAll(s));
  const math = q("span.math, div.math").filter(e => !e.closest("script, pre, code"));
  const views = q('script[type="application/vnd.jupyter.widget-view+json"]');
  const imgs = q(".bd-article img");
  const r = {
    math: math.length,
    typeset: math.filter(e => e.querySelector("mjx-container")).length,
    math_errors: q("mjx-merror, [data-mjx-error]").length,
    views: views.length,
    widgets: views.filter(s => { const p = s.previousElementSibling;
      return p && p.classList.contains("widget-subarea") && p.querySelector(".jupyter-widgets"); }).length,
    widget_errors: q(".jupyter-widgets .widget-error, .jupyter-widgets-error-widget").length,
    images: imgs.length,
    loaded: imgs.filter(i => i.complete && i.naturalWidth > 0).length,
    missing: imgs.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src.slice(0, 80)),
  };
  document.body.setAttribute("data-book-check", JSON.stringify(r));
});
</script>"""


def chromium_args(binary: str, profile: str) -> list[str]:
    """Headless Chromium that cannot reach the network: every host name fails to resolve."""
    return [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
            "--host-resolver-rules=MAP * ~NOTFOUND", "--virtual-time-budget=20000"]


def render(binary: str, page: Path) -> dict | None:
    """What rendered on `page`, measured by PROBE in a copy of the page beside it (same relative links)."""
    probe = page.with_name(f"_book_check_{page.name}")
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>", 1), "utf-8")
    try:
        with tempfile.TemporaryDirectory() as profile:
            dom = subprocess.run(chromium_args(binary, profile) + ["--dump-dom", probe.as_uri()],
                                 capture_output=True, text=True, timeout=300).stdout
    finally:
        probe.unlink()
    found = re.search(r'data-book-check="([^"]*)"', dom)
    return json.loads(html.unescape(found.group(1))) if found else None


def check_page(binary: str, page: Path, label: str, screenshot: Path | None) -> list[str]:
    """Problems found on one page (empty when everything on it rendered)."""
    source = page.read_text(encoding="utf-8")
    problems = [f"loads a remote asset: {m.group(0)}" for m in REMOTE_ASSET.finditer(source)]
    for name, pattern in LOCAL_SCRIPTS.items():
        src = pattern.search(source)
        if src and not (page.parent / src.group(1).split("?")[0]).is_file():
            problems.append(f"{name} script {src.group(1)} is missing from the build")
    if WIDGET_VIEW in source and not LOCAL_SCRIPTS["widget manager"].search(source):
        problems.append("has widgets but no local widget manager <script> (jupyter-widgets/embed.js)")
    r = render(binary, page)
    if r is None:
        return problems + ["the page did not finish loading in headless Chromium"]
    if r["typeset"] < r["math"]:
        problems.append(f"MathJax typeset {r['typeset']} of {r['math']} math elements")
    if r["math_errors"]:
        problems.append(f"{r['math_errors']} MathJax error(s)")
    if r["widgets"] < r["views"]:
        problems.append(f"{r['widgets']} of {r['views']} widgets rendered")
    if r["widget_errors"]:
        problems.append(f"{r['widget_errors']} widget error view(s)")
    problems += [f"image did not load: {src}" for src in r["missing"]]
    if screenshot is not None:
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run(chromium_args(binary, profile) + ["--window-size=1280,2400", f"--screenshot={screenshot}",
                                                             page.as_uri()], capture_output=True, timeout=300)
    print(f"{'ok  ' if not problems else 'FAIL'} {label}: math {r['typeset']}/{r['math']}, "
          f"widgets {r['widgets']}/{r['views']}, images {r['loaded']}/{r['images']}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build", nargs="?", default=str(ROOT / "_build" / "html"), help="built HTML folder")
    parser.add_argument("--screenshots", metavar="DIR", help="also save a PNG of the top of each page here")
    parser.add_argument("--require", action="store_true", help="fail, not skip, when Chromium is absent")
    args = parser.parse_args(argv)

    binary = next((b for b in map(shutil.which, BROWSERS) if b), None)
    if binary is None:
        print("SKIP: no Chromium found (on Debian: apt-get install chromium)")
        return 1 if args.require else 0
    build = Path(args.build).resolve()
    pages = sorted(p for p in build.rglob("*.html")
                   if not p.relative_to(build).parts[0].startswith("_") and not p.name.startswith("_")
                   and p.name not in ("genindex.html", "search.html") and "bd-article" in p.read_text("utf-8"))
    if not any(p.parent.name == "chapters" for p in pages):
        print(f"FAIL: no built chapter under {build} (run `make book` first)")
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
    print(f"{len(pages)} page(s) checked, {failures} problem(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
