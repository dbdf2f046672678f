"""Apply a preset (an overlay of params.yaml in pipelines/presets/) to params.yaml, keeping its comments.

    python -m pipelines.preset ci                     # rewrite ./params.yaml with the ci preset
    python -m pipelines.preset ci --params other.yaml

DVC and Snakemake both read params.yaml, so a preset is applied to that file (in a scratch clone, or
as a DVC experiment: `dvc exp run -S tokenize.vocab_size=512`), not passed around as a flag.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ruamel.yaml import YAML

PRESETS = Path(__file__).resolve().parent / "presets"


def available() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def preset_path(name: str) -> Path:
    path = PRESETS / f"{name}.yaml"
    if not path.is_file():
        raise SystemExit(f"preset: unknown preset {name!r}; available: {', '.join(available())}")
    return path


def _overlay(target, overlay, where: str) -> None:
    for key, value in overlay.items():
        if where == "" and key == "sweeps":  # (its entries are the preset's own: named by it, not changed keys)
            target[key] = value
            continue
        if key not in target:
            raise SystemExit(f"preset: {where}{key} is not in params.yaml; presets may only change existing keys")
        if isinstance(value, dict):
            _overlay(target[key], value, f"{where}{key}.")
        else:
            target[key] = value


def apply(name: str, params: Path = Path("params.yaml")) -> None:
    yaml = YAML()
    yaml.preserve_quotes = True
    doc = yaml.load(params.read_text())
    _overlay(doc, YAML(typ="safe").load(preset_path(name).read_text()) or {}, "")
    tmp = params.with_name(params.name + ".tmp")
    with open(tmp, "w") as fh:
        yaml.dump(doc, fh)
    tmp.replace(params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset", choices=available())
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    args = parser.parse_args()
    from pipelines import dag

    before = dag.base_kind(args.params)
    apply(args.preset, args.params)
    print(f"applied preset {args.preset} to {args.params}")
    if dag.base_kind(args.params) != before and args.params.resolve() == dag.ROOT / "params.yaml":
        dag.main(["write"])  # (the base model changed kind: dvc.yaml's stages follow it)


if __name__ == "__main__":
    main()
