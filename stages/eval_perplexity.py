"""eval_perplexity: sliding-window perplexity of causal LMs at several context lengths.

Evaluates Hugging Face checkpoints (and base + PEFT adapter pairs) on one split of the tokenize
stage's shards (`--input`, format in stages/common/shards.py) or on a text file tokenized with each
model's own tokenizer (`--text`). Writes to `--output`:
    meta.json                           compute dtype, world size, the CPU the kernels were chosen for, the
                                        code's hash and the package versions
    figures.json                        per model and context: nll, perplexity, bits_per_byte,
                                        byte_perplexity, word_perplexity, tokens, and per-position
                                        buckets when asked
    metrics.json                        each model's perplexity at the longest context (DVC metrics)
    table.csv                           the same numbers in long format (model, context, metric, value),
                                        for pandas or a spreadsheet
    plots/perplexity_vs_context.png     token perplexity against context length, one line per model
    plots/perplexity/<model>.csv        context, perplexity (DVC plots)

Protocols (`protocol`): `stream` (the default) scores the split as one token stream, as below;
`wikitext` scores a raw WikiText file (`--text .../wiki.test.raw`) as lm-evaluation-harness's `wikitext`
task does (stages/common/wikitext.py): one document per article, detokenized, tokenized by each model's
tokenizer with its default special tokens, each document after a prefix token (bos, else eos) in
non-overlapping windows of the context (`contexts` play the harness's `max_length`), the last window of a
document reaching back a full context; word perplexity, byte perplexity and bits per byte count the
words and bytes of the raw documents. Its figures equal the harness's (tests/test_harness_parity.py).

Windows (`stream`): the model reads ids[b : b + context] and predicts ids[b + 1 : b + context + 1]; window k
starts at b = k * stride, and only targets no earlier window scored are counted. Every token but the
first of the stream is scored exactly once (`stride == context`: non-overlapping windows); after the
first window each scored token sees at least `context - stride + 1` tokens. The last window is
shorter when the stream ends. The mean is token-weighted, accumulated in float64. (The Hugging Face
perplexity guide feeds the target inside the window, so with stride == context it skips the first
token of every window; here no token is skipped.) Byte and word figures divide the total NLL by the
split's UTF-8 bytes and whitespace-separated words, as lm-evaluation-harness defines them.

Models: `--models label=path ...`; a PEFT adapter on a base model is `label=base_dir+adapter_dir`
(loaded as `PeftModel.from_pretrained(base, adapter_dir)`); without `label=` the label is the last
folder name. A model of the MLflow model registry is `models:/<name>@<alias>` or
`models:/<name>/<version>` (labelled by its name unless `label=` is given; the run is tagged with the
version it resolved to). A folder holding checkpoints in subfolders (and no config.json of its own) stands for
all of them, each labelled by its subfolder's name. Labels must differ from this stage's params keys.

Run:
    python -m stages.eval_perplexity --models pretrain=data/pretrain/model --input data/tokenize \\
        --output data/eval_perplexity/pretrain [key=value ...]
    python -m stages.eval_perplexity --models base=ckpt/base lora=ckpt/base+ckpt/adapter \\
        --text notes.txt --output data/eval_perplexity/notes contexts=[256,512] extrapolate=true
    torchrun --nproc-per-node 2 -m stages.eval_perplexity --models pretrain=data/pretrain/model \\
        --input data/tokenize --output data/eval_perplexity/pretrain
    python -m stages.eval_perplexity --models models:/pretrain@reproduced --input data/tokenize \\
        --output data/eval_perplexity/registered
"""

from __future__ import annotations

import csv
import dataclasses
import gc
import itertools
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from stages.common import (
    atomic,
    config,
    faults,
    hf_folder,
    registry,
    runtime,
    shards,
    stage,
    timing,
    watchdog,
    wikitext,
)
from stages.common.tracking.tracker import Tracker

STAGE = "eval_perplexity"
METRICS = ("nll", "perplexity", "bits_per_byte", "byte_perplexity", "word_perplexity", "tokens")


@dataclass(frozen=True)
class Config:
    contexts: tuple[int, ...]
    stride: int | None
    batch_size: int
    split: str
    extrapolate: bool
    position_buckets: tuple[int, ...]
    max_tokens: int
    prepend_bos: bool
    precision: str
    protocol: str = "stream"  # stream | wikitext (see the module docstring)
    max_documents: int = 0  # wikitext: evaluate the first N documents (0 = all), like the harness's --limit
    # A rank without a finished batch for this long (or 10 median batches, whichever is longer) ends the
    # stage, naming it (stages.common.watchdog), instead of the others waiting out the collective timeout.
    hang_timeout_s: float = 300.0

    def __post_init__(self):
        runtime.check_precision(self.precision)
        if not self.hang_timeout_s > 0:
            raise ValueError(f"hang_timeout_s must be > 0 seconds, got {self.hang_timeout_s}")
        if not self.contexts or min(self.contexts) < 1 or list(self.contexts) != sorted(set(self.contexts)):
            raise ValueError(
                f"contexts must be a non-empty list of increasing positive ints, got {list(self.contexts)}"
            )
        if self.stride is not None and not 1 <= self.stride <= min(self.contexts):
            raise ValueError(
                f"stride must be between 1 and the smallest context ({min(self.contexts)}), got "
                f"{self.stride}; null gives non-overlapping windows"
            )
        if self.batch_size < 1 or self.max_tokens < 0 or self.max_documents < 0:
            raise ValueError("batch_size must be >= 1, max_tokens and max_documents >= 0 (0 = the whole split)")
        if self.protocol not in ("stream", "wikitext"):
            raise ValueError(f"protocol must be stream or wikitext, got {self.protocol!r}")
        if self.protocol == "wikitext" and (self.stride is not None or self.max_tokens):
            raise ValueError(
                "protocol wikitext scores whole documents in non-overlapping windows, as the harness does: "
                "set stride: null and max_tokens: 0 (max_documents N evaluates the first N documents)"
            )
        if self.protocol == "stream" and self.max_documents:
            raise ValueError("max_documents applies to protocol wikitext; use max_tokens with protocol stream")
        edges = self.position_buckets
        if any(e < 1 for e in edges) or list(edges) != sorted(set(edges)):
            raise ValueError(f"position_buckets must be increasing positive ints, got {list(edges)}")


@dataclass(frozen=True)
class ModelSpec:
    label: str
    path: Path
    adapter: Path | None
    registered: str = ""  # models:/<name>/<version> of a registered model


class Tokens:
    """The ids a model is scored on: bos (when prepended), then the first `limit` ids (0: all) of a token
    stream, which for shards is read through memory maps (shards.TokenStream): `len()` and `[start:stop]`
    slices as int64 arrays, without the split in memory."""

    def __init__(self, stream: shards.TokenStream, bos: int | None, limit: int = 0):
        self.stream, self.bos = stream, bos
        self.n = min(len(stream), limit) if limit else len(stream)

    def __len__(self) -> int:
        return self.n + (self.bos is not None)

    def __getitem__(self, key: slice) -> np.ndarray:
        start, stop, _ = key.indices(len(self))
        if self.bos is None:
            return self.stream[start:stop]
        head = [np.array([self.bos], dtype=np.int64)] if start == 0 < stop else []
        return np.concatenate([*head, self.stream[max(start - 1, 0) : max(stop - 1, 0)]])


@dataclass(frozen=True)
class Stream:
    """What a model is scored on. `documents` (protocol wikitext): (start, n) per document, whose prefix
    token is ids[start] and its n tokens follow; None: ids is one stream (protocol stream)."""

    ids: Tokens | np.ndarray
    bytes: int
    words: int
    documents: tuple[tuple[int, int], ...] | None = None

    def windows(self, context: int, stride: int) -> list[tuple[int, int, int]]:
        """The windows to score, as plan_windows gives them."""
        if self.documents is None:
            return plan_windows(len(self.ids), context, stride)
        return [w for start, n in self.documents for w in document_windows(start, n, context)]


def parse_models(items: list[str]) -> list[ModelSpec]:
    specs = []
    for item in items:
        label, _, where = item.partition("=") if "=" in item else ("", "", item)
        if registry.is_uri(where):
            # A registered version (the registry's folder, as its stage wrote it), labelled by its name.
            folder, version = registry.resolve(where)
            default = version.removeprefix("models:/").rpartition("/")[0]
            specs.append(ModelSpec(label or default, folder, None, version))
            continue
        base, _, adapter = where.partition("+")
        family = sorted(d for d in Path(base).glob("*/") if (d / "config.json").is_file())
        if not adapter and not (Path(base) / "config.json").is_file() and family:
            # A folder of checkpoints (e.g. extend_context's variants): one model per subfolder.
            specs += [ModelSpec(d.name, d, None) for d in family]
            continue
        label = label or Path(adapter or base).name
        specs.append(ModelSpec(label, Path(base), Path(adapter) if adapter else None))
    for spec in specs:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", spec.label):
            raise config.UserError(
                f"eval_perplexity: model label {spec.label!r} must be letters, digits, '_', '.', '-'"
            )
    labels = [s.label for s in specs]
    if not specs or len(set(labels)) != len(labels):
        raise config.UserError(f"eval_perplexity: pass --models label=path ... with distinct labels, got {labels}")
    return specs


def check_checkpoint(spec: ModelSpec):
    """The model's config, after checking that every file it needs is there (no weights are read)."""
    from transformers import AutoConfig

    for folder, adapter in ((spec.path, False), (spec.adapter, True)):
        if folder is None:
            continue
        where = f"eval_perplexity: --models {spec.label}: {folder}"
        if not folder.is_dir():
            raise config.UserError(
                f"{where} not found; pass an existing Hugging Face checkpoint folder "
                f"(if '{spec.label}' was meant as a params key, it is not one of this stage's)"
            )
        hf_folder.check(folder, where, "it is not a complete checkpoint (save_pretrained)", adapter=adapter)
    return AutoConfig.from_pretrained(spec.path)


def model_tokenizer(spec: ModelSpec):
    """The tokenizer saved beside the adapter or the model, or None."""
    from transformers import AutoTokenizer

    for folder in (spec.adapter, spec.path):
        if folder and ((folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()):
            return AutoTokenizer.from_pretrained(folder)
    return None


def make_stream(ids: shards.TokenStream, tok, counts: tuple[int, int] | None, cfg: Config, bos: int | None) -> Stream:
    """Cap the ids at max_tokens (bytes and words then come from the decoded prefix) and prepend bos."""
    if cfg.max_tokens and len(ids) > cfg.max_tokens:
        text = tok.decode(ids[: cfg.max_tokens].tolist(), skip_special_tokens=True)
        counts = (len(text.encode("utf-8")), len(text.split()))
    if cfg.prepend_bos and bos is None:
        raise config.UserError(
            "eval_perplexity: the tokenizer has no bos or eos token; set eval_perplexity.prepend_bos: false"
        )
    return Stream(Tokens(ids, bos if cfg.prepend_bos else None, cfg.max_tokens), *counts)


def shard_stream(folder: Path, cfg: Config):
    from transformers import AutoTokenizer

    try:
        meta = shards.read_meta(folder)
        ids = shards.open_stream(folder, cfg.split)  # memory-mapped: each rank reads the windows it scores
    except FileNotFoundError as e:
        raise config.UserError(f"eval_perplexity: {e.args[0]}; or pass --input FOLDER or --text FILE") from None
    except KeyError as e:
        raise config.UserError(f"eval_perplexity: {e.args[0]}; set eval_perplexity.split") from None
    if not (folder / "tokenizer" / "tokenizer.json").is_file():
        raise config.UserError(
            f"eval_perplexity: no tokenizer in {folder / 'tokenizer'} (the tokenize stage writes it "
            f"beside the shards); re-run tokenize, or pass --text FILE to use each model's own"
        )
    try:
        shards.check_tokenizer(folder)
    except config.UserError as e:
        raise config.UserError(f"eval_perplexity: {e}") from None
    tok = AutoTokenizer.from_pretrained(folder / "tokenizer")
    split = meta["splits"][cfg.split]
    return make_stream(ids, tok, (split["bytes"], split["words"]), cfg, meta["bos_token_id"]), tok


def text_stream(path: Path, tok, cfg: Config) -> Stream:
    text = path.read_text(encoding="utf-8")
    ids = shards.TokenStream([np.asarray(tok(text, add_special_tokens=False)["input_ids"], dtype=np.int64)])
    bos = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    return make_stream(ids, tok, (len(text.encode("utf-8")), len(text.split())), cfg, bos)


def wikitext_stream(docs: list[str], tok, label: str) -> Stream:
    """Each document detokenized and tokenized as the harness's hf model does, after the prefix token."""
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    if prefix is None:
        raise config.UserError(
            f"eval_perplexity: model '{label}''s tokenizer has no bos or eos token to start each document with "
            f"(protocol wikitext); evaluate it with protocol: stream"
        )
    pieces, spans, start = [], [], 0
    for doc in docs:
        ids = tok(wikitext.detokenize(doc))["input_ids"]
        pieces.append(np.asarray([prefix, *ids], dtype=np.int64))
        spans.append((start, len(ids)))
        start += len(ids) + 1
    words, n_bytes = (sum(c) for c in zip(*map(wikitext.counts, docs), strict=True))
    return Stream(np.concatenate(pieces), n_bytes, words, tuple(spans))


def read_documents(path: Path, cfg: Config) -> list[str]:
    try:
        docs = wikitext.documents(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise config.UserError(
            f"eval_perplexity: --text {path}: {e}; protocol wikitext reads a raw WikiText split"
        ) from None
    return docs[: cfg.max_documents] if cfg.max_documents else docs


def prepare(specs: list[ModelSpec], cfg: Config, shards_dir: Path, text: Path | None) -> dict[str, Stream]:
    """Every check that needs no weights: files, context limits, vocabularies, split length."""
    model_configs = [check_checkpoint(spec) for spec in specs]
    if text is not None and not text.is_file():
        raise config.UserError(f"eval_perplexity: --text {text} not found")
    if cfg.protocol == "wikitext" and text is None:
        raise config.UserError(
            "eval_perplexity: protocol wikitext evaluates a raw WikiText split; pass --text FILE "
            "(e.g. wikitext-2-raw/wiki.test.raw)"
        )
    docs = read_documents(text, cfg) if cfg.protocol == "wikitext" else None
    shared, shared_tok = shard_stream(shards_dir, cfg) if text is None else (None, None)
    streams = {}
    for spec, mcfg in zip(specs, model_configs, strict=True):
        limit = getattr(mcfg, "max_position_embeddings", None)
        if limit and max(cfg.contexts) > limit and not cfg.extrapolate:
            raise config.UserError(
                f"eval_perplexity: context {max(cfg.contexts)} is longer than model '{spec.label}' "
                f"was configured for ({limit} positions); set eval_perplexity.extrapolate: true "
                f"to evaluate beyond it, or lower eval_perplexity.contexts"
            )
        tok = model_tokenizer(spec)
        if text is not None and tok is None:
            raise config.UserError(
                f"eval_perplexity: --text needs the model's tokenizer; none in {spec.adapter or spec.path}"
            )
        if shared_tok is not None and tok is not None and tok.get_vocab() != shared_tok.get_vocab():
            raise config.UserError(
                f"eval_perplexity: model '{spec.label}' has a different tokenizer from "
                f"{shards_dir}/tokenizer; evaluate it with --text or its own shards"
            )
        if docs is not None:
            stream = wikitext_stream(docs, tok, spec.label)
        else:
            stream = shared if text is None else text_stream(text, tok, cfg)
        vocab = len(shared_tok if text is None else tok)
        if vocab > mcfg.vocab_size:  # every id is below the tokenizer's vocab
            raise config.UserError(
                f"eval_perplexity: tokenizer vocab ({vocab} ids) does not fit model '{spec.label}' "
                f"(config.vocab_size {mcfg.vocab_size}); use the tokenizer the model was trained with"
            )
        if docs is not None:
            if len(stream.ids) == len(docs):
                raise config.UserError(f"eval_perplexity: --text {text}: the documents hold no tokens to score")
        elif len(stream.ids) <= max(cfg.contexts):
            raise config.UserError(
                f"eval_perplexity: the split has {len(stream.ids)} tokens, fewer than one window of "
                f"context {max(cfg.contexts)} plus its next token; lower eval_perplexity.contexts, "
                f"raise eval_perplexity.max_tokens (0 = all) or use a longer split"
            )
        streams[spec.label] = stream
    return streams


def plan_windows(n_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, length, first) per window: the model reads ids[begin : begin + length] and its
    predictions at positions >= first are scored (earlier ones were scored by the previous window)."""
    windows, begin, scored_to = [], 0, 0  # scored_to: highest target index scored so far
    while True:
        end = min(begin + context, n_tokens - 1)
        windows.append((begin, end - begin, scored_to - begin))
        if end == n_tokens - 1:
            return windows
        scored_to, begin = end, begin + stride


def document_windows(start: int, n: int, context: int) -> list[tuple[int, int, int]]:
    """plan_windows' (begin, length, first) for a document of n tokens after its prefix token at ids[start],
    as the harness rolls them: window k scores tokens [k*context, min((k+1)*context, n)) of the document,
    reading the `context` ids before each (fewer in the first window); the last window reads a full
    context even where it overlaps the one before, and scores only its new tokens."""
    windows = []
    for a in range(0, n, context):
        b = min(a + context, n)
        length = min(context, b)
        windows.append((start + b - length, length, length - (b - a)))
    return windows


def batches(windows: list, size: int):
    """Runs of at most `size` consecutive windows of equal length (only the last window is shorter)."""
    batch = []
    for w in windows:
        if batch and (len(batch) == size or w[1] != batch[0][1]):
            yield batch
            batch = []
        batch.append(w)
    if batch:
        yield batch


@timing.phase("evaluation")
@torch.inference_mode()
def evaluate(
    model, stream: Stream, context: int, stride: int, batch_size: int, rt: runtime.Runtime, watch=None, what: str = ""
) -> torch.Tensor:
    """(2, context) float64: NLL sum and scored-token count per prediction position, summed over ranks.
    Each batch is a beat of `watch` (a watchdog.Watchdog; `what` names the model and context)."""
    ids, plan = stream.ids, stream.windows(context, stride)
    mine = plan[rt.rank * len(plan) // rt.world_size : (rt.rank + 1) * len(plan) // rt.world_size]
    sums = torch.zeros(2, context, dtype=torch.float64, device=rt.device)
    mine_batches = list(batches(mine, batch_size))
    for i, batch in enumerate(mine_batches):
        started = time.perf_counter()
        if watch is not None:
            faults.injected_stall(rt.rank, watch.done)
            watch.beat(where=f"in batch {i + 1} of {len(mine_batches)} ({what})")
        length, first = batch[0][1], min(w[2] for w in batch)
        keep = length - first  # only these positions' logits are needed
        rows = np.stack([ids[w[0] : w[0] + length + 1] for w in batch])
        tokens = torch.from_numpy(rows).to(rt.device, non_blocking=True)  # (B, length + 1)
        logits = model(input_ids=tokens[:, :-1], logits_to_keep=keep, use_cache=False).logits  # (B, keep, V)
        nll = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, first + 1 :].flatten(), reduction="none")
        nll = nll.view(len(batch), keep).double()
        pos = torch.arange(first, length, device=rt.device)
        scored = pos[None, :] >= torch.tensor([w[2] for w in batch], device=rt.device)[:, None]  # (B, keep)
        sums[0, first:length] += torch.where(scored, nll, 0.0).sum(0)
        sums[1, first:length] += scored.sum(0)
        if watch is not None:
            watch.beat(
                watch.done + 1, f"after batch {i + 1} of {len(mine_batches)} ({what})", time.perf_counter() - started
            )
    if watch is not None:
        watch.beat(where=f"summing the ranks' results ({what})")
    return runtime.all_reduce_sum(sums)


def safe_exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:  # a word perplexity of a random model can exceed the float range
        return math.inf


def summarize(nll_sum: float, tokens: int, n_bytes: int, n_words: int) -> dict:
    """Token, byte and word figures from the total NLL (nats), as lm-evaluation-harness defines them."""
    return {
        "nll": nll_sum / tokens,
        "perplexity": safe_exp(nll_sum / tokens),
        "bits_per_byte": nll_sum / (n_bytes * math.log(2)),
        "byte_perplexity": safe_exp(nll_sum / n_bytes),
        "word_perplexity": safe_exp(nll_sum / n_words) if n_words else math.nan,
        "tokens": tokens,
    }


def position_buckets(sums: torch.Tensor, edges: tuple[int, ...]) -> dict:
    """Token-weighted NLL and perplexity of predictions made at positions [lo, hi) of the window."""
    context = sums.shape[1]
    bounds = [0, *[e for e in edges if e < context], context]
    out = {}
    for lo, hi in itertools.pairwise(bounds):
        nll, n = sums[0, lo:hi].sum().item(), int(sums[1, lo:hi].sum().item())
        if n:
            out[f"{lo}-{hi}"] = {"nll": nll / n, "perplexity": safe_exp(nll / n), "tokens": n}
    return out


def load_model(spec: ModelSpec, rt: runtime.Runtime, precision: str = "auto"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        spec.path, dtype=runtime.compute_dtype(rt.device, precision), use_safetensors=True
    )
    if spec.adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, spec.adapter)
    return model.to(rt.device).eval()


def table_rows(metrics: dict) -> list[tuple]:
    rows = []
    for label, per_context in metrics["models"].items():
        for key, m in per_context.items():
            context = int(key.removeprefix("ctx"))
            rows += [(label, context, name, m[name]) for name in METRICS]
            rows += [(label, context, f"perplexity_pos_{b}", v["perplexity"]) for b, v in m.get("buckets", {}).items()]
    return rows


def plot(metrics: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, per_context in metrics["models"].items():
        xs = [int(k.removeprefix("ctx")) for k in per_context]
        ax.plot(xs, [m["perplexity"] for m in per_context.values()], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="context length (tokens)", ylabel="token perplexity", title="Perplexity vs context length")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def headline(metrics: dict) -> dict:
    """metrics.json: each model's token perplexity at the longest context evaluated."""
    return {
        "perplexity": {
            label: per_context[max(per_context, key=lambda k: int(k.removeprefix("ctx")))]["perplexity"]
            for label, per_context in metrics["models"].items()
        }
    }


def write_outputs(metrics: dict, folder: Path) -> None:
    stage.write_metrics(folder, metrics, headline(metrics))
    with open(folder / "table.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(("model", "context", "metric", "value"))
        writer.writerows(table_rows(metrics))
    plot(metrics, folder / "plots" / "perplexity_vs_context.png")
    # DVC plots: one file per model (each drawn on its own, compared across revisions)
    (folder / "plots" / "perplexity").mkdir(parents=True, exist_ok=True)
    for label, per_context in metrics["models"].items():
        with open(folder / "plots" / "perplexity" / f"{label}.csv", "w") as fh:
            fh.write("context,perplexity\n")
            fh.writelines(f"{m['context']},{m['perplexity']:.6f}\n" for m in per_context.values())


def run(specs, streams, cfg: Config, output: Path, measured: Path, rt: runtime.Runtime, tracker: Tracker) -> dict:
    first = next(iter(streams.values()))
    metrics = {"protocol": cfg.protocol, "bytes": first.bytes, "words": first.words, "models": {}}
    if first.documents is not None:
        metrics["documents"] = len(first.documents)
    speed = {}  # {model: {ctx<n>: tokens/s}}: measured, outside the output
    dtype = runtime.compute_dtype(rt.device, cfg.precision)
    runtime.warn_if_emulated_bf16(rt.device, dtype, rt)
    with watchdog.watching(rt, cfg.hang_timeout_s, tracker.fail_from_thread) as watch, atomic.folder(output, rt) as tmp:
        for spec in specs:
            watch.beat(where=f"loading {spec.label}")
            model, stream = load_model(spec, rt, cfg.precision), streams[spec.label]
            results = metrics["models"][spec.label] = {}
            for context in cfg.contexts:
                stride = cfg.stride or context
                runtime.barrier()
                t0 = time.perf_counter()
                what = f"{spec.label}, context {context}"
                sums = evaluate(model, stream, context, stride, cfg.batch_size, rt, watch, what).cpu()
                seconds = time.perf_counter() - t0
                tokens = int(sums[1].sum().item())
                tokens_per_s = tokens / max(seconds, 1e-9)
                speed.setdefault(spec.label, {})[f"ctx{context}"] = {"tokens_per_s": tokens_per_s}
                m = {
                    **summarize(sums[0].sum().item(), tokens, stream.bytes, stream.words),
                    "context": context,
                    "stride": stride,
                }
                if cfg.position_buckets:
                    m["buckets"] = position_buckets(sums, cfg.position_buckets)
                results[f"ctx{context}"] = m
                runtime.print0(
                    f"eval_perplexity: {spec.label} context {context} stride {stride}: perplexity "
                    f"{m['perplexity']:.4f}, {m['bits_per_byte']:.4f} bits/byte, {tokens:,} tokens, "
                    f"{tokens_per_s:,.0f} tokens/s",
                    rt=rt,
                )
                figures = {f"{spec.label}.{k}": v for k, v in m.items() if k in METRICS}
                tracker.log_metrics({**figures, f"{spec.label}.tokens_per_s": tokens_per_s}, step=context)
                tracker.log_metrics(
                    {f"{spec.label}.perplexity_pos_{b}": v["perplexity"] for b, v in m.get("buckets", {}).items()},
                    step=context,
                )
            del model  # before the next model loads
            gc.collect()
        if rt.is_main:
            write_outputs(metrics, tmp)
            # Kernels (and so the last digits of the perplexities) depend on the CPU and the dtype.
            atomic.write_json(
                tmp / "meta.json",
                {
                    "compute_dtype": str(dtype),
                    "world_size": rt.world_size,
                    "cpu": runtime.cpu_info(),
                    **stage.code_record(STAGE),
                },
            )
    if rt.is_main:
        stage.write_measured(measured, output, {"models": speed})
        tracker.log_artifact(measured)
        for name in ("figures.json", "meta.json", "table.csv", "plots"):
            tracker.log_artifact(output / name, "plots" if name == "plots" else None)
    return metrics


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, overrides = stage.parse_cli(__doc__, {"models": [], "input": "data/tokenize", "text": "", "output": ""}, argv)
    # `label=path` model specs look like overrides to the shared parser; params keys tell them apart.
    keys = {f.name for f in dataclasses.fields(Config)}

    def is_key(item: str) -> bool:
        return item.partition("=")[0].removeprefix(f"{STAGE}.") in keys

    model_items = sorted([m for m in args.models + overrides if not is_key(m)], key=argv.index)
    cfg = config.load(Config, STAGE, args.params, [o for o in overrides if is_key(o)])
    specs = parse_models(model_items)
    if not args.output and len(specs) > 1:
        raise config.UserError("eval_perplexity: pass --output when evaluating several models")
    output = Path(args.output or f"data/{STAGE}/{specs[0].label}")
    measured = Path(args.measured or f"{output}.measured.json")
    text = Path(args.text) if args.text else None
    streams = prepare(specs, cfg, Path(args.input), text)  # reads the models' tokenizers and the text
    stage.exit_if_checking(args, STAGE, cfg)
    inputs = [p for s in specs for p in (s.path, s.adapter) if p] + [text or Path(args.input)]
    tags = {"models": " ".join(model_items), "data": str(text or f"{args.input}:{cfg.split}")}
    tags |= {f"model.{s.label}": s.registered for s in specs if s.registered}

    def body(rt, stop):
        with stage.tracked(STAGE, cfg, inputs, rt, tags=tags) as (tracker, _):
            metrics = run(specs, streams, cfg, output, measured, rt, tracker)
        runtime.print0(f"eval_perplexity: {len(specs)} model(s) x {len(cfg.contexts)} context(s) -> {output}", rt=rt)
        return metrics

    return stage.launch(STAGE, body)


if __name__ == "__main__":
    stage.entry(main)
