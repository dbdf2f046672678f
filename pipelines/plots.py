"""Offline page for `dvc plots show`.

DVC's default page loads Vega, Vega-Lite and Vega-Embed from a CDN, so without network its line plots
stay blank. This writes an HTML template with those libraries inlined from the installed
vl-convert-python, so that `dvc plots show` given it renders with no network (`make plots` does both):

    python -m pipelines.plots                                     # writes .dvc/plots/offline.html
    dvc plots show --html-template .dvc/plots/offline.html        # dvc_plots/index.html, self-contained
"""

import argparse
from pathlib import Path

from stages.common import atomic

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / ".dvc" / "plots" / "offline.html"
# dvc-render fills Vega-Lite v5 templates; the bundled compiler matches them.
VEGA_LITE = "5.21"

PAGE = """<!DOCTYPE html>
<html>
<head>
<meta charset="utf-8">
{refresh_tag}
<title>Pipeline plots</title>
<script>
(function () {
%BUNDLE%
})();
</script>
<style>
body { font-family: sans-serif; }
table { border-spacing: 15px; }
</style>
</head>
<body>
{plot_divs}
</body>
</html>
"""


def page() -> str:
    """The template: dvc-render's placeholders, with vegaEmbed, vega and vegaLite defined inline."""
    import vl_convert

    # The bundle assigns window.vegaEmbed/vega/vegaLite; the wrapper keeps its other names out of the
    # page's global scope, where DVC's own inline scripts run.
    return PAGE.replace("%BUNDLE%", vl_convert.javascript_bundle(vl_version=VEGA_LITE))


def write(path: Path = TEMPLATE) -> bool:
    """Write the template atomically; False when the file already holds it."""
    text = page()
    if path.is_file() and path.read_text(encoding="utf8") == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(path, text)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=TEMPLATE, help="template path (default: %(default)s)")
    args = parser.parse_args()
    print(f"{'wrote' if write(args.output) else 'up to date'}: {args.output}")


if __name__ == "__main__":
    main()
