"""eval_perplexity against a plain one-window-at-a-time reference loop, on a tiny random Llama.

The reference loop is written here independently of the stage: window k reads
ids[k*stride : k*stride + context] (cut at the token before the last), and scores every next token
that no earlier window scored, one window at a time, in float64.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import shutil

import numpy as np
import pytest
import torch
from conftest import TRACKED, ci_params, run_stage

from stages import eval_perplexity, tokenize
from stages.common import config, runtime, shards

REL = 1e-6
MAX_POSITIONS = 64


def tiny_llama(vocab_size: int, seed: int = 0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
        initializer_range=0.2,
        **overrides,
    )  # larger init: predictions depend on the context
    return LlamaForCausalLM(cfg)


def byte_bpe(text: str, folder, vocab_size: int):
    """The tokenize stage's byte-level BPE trained on `text`, saved in Hugging Face format in `folder`."""
    corpus = folder / "corpus"
    corpus.mkdir(parents=True)
    (corpus / "train.txt").write_text(text)
    cfg = tokenize.Config(vocab_size=vocab_size, min_frequency=2, train_max_bytes=0, batch_lines=64, shard_tokens=1)
    tok = tokenize.train_tokenizer(corpus, cfg, show_progress=False)
    shutil.rmtree(corpus)
    return tok


@pytest.fixture(scope="module")
def assets(tmp_path_factory, mirror):
    """A tiny Llama with its tokenizer, a LoRA adapter on it, an eval text, and that text as token shards."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("eval")
    full = (mirror / "tinyshakespeare" / "input.txt").read_text()
    tok = byte_bpe(full[:20000], root, vocab_size=320)
    tokenize.save_hf_tokenizer(tok, root / "model")
    hf_tok = AutoTokenizer.from_pretrained(root / "model")
    model = tiny_llama(len(hf_tok))
    model.save_pretrained(root / "model")
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    lora.save_pretrained(root / "adapter")

    text = full[20000:23000]
    (root / "eval.txt").write_text(text)
    # The same text as the tokenize stage's shards: line by line, one eos at the end, small shard files.
    out = root / "shards"
    out.mkdir()
    tokenize.save_hf_tokenizer(tok, out / "tokenizer")
    ids = [i for line in text.splitlines(keepends=True) for i in tok.encode(line, add_special_tokens=False).ids]
    ids.append(hf_tok.eos_token_id)
    writer = shards.ShardWriter(out, "test", shards.dtype_for(len(hf_tok)), shard_tokens=500)
    writer.write(np.array(ids))
    meta = {
        "format": shards.FORMAT,
        "dtype": "uint16",
        "vocab_size": len(hf_tok),
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 1,
        "shard_tokens": 500,
        "splits": {
            "test": {
                "tokens": len(ids),
                "bytes": len(text.encode()),
                "words": len(text.split()),
                "documents": 1,
                "shards": writer.close(),
            }
        },
    }
    (out / "meta.json").write_text(json.dumps(meta))
    ci_params(root)
    return root


@pytest.fixture
def in_root(assets, monkeypatch):
    monkeypatch.chdir(assets)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{assets / 'mlflow.db'}")
    monkeypatch.delenv("PIPELINE_RUN_ID", raising=False)
    return assets


def load(root, adapter: bool = False):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    return (PeftModel.from_pretrained(model, root / "adapter") if adapter else model).eval()


@torch.inference_mode()
def reference(model, ids: list[int], context: int, stride: int) -> dict:
    n = len(ids)
    done = np.zeros(n, dtype=bool)
    done[0] = True  # the first token has no context
    total, pos_nll, pos_n = 0.0, np.zeros(context), np.zeros(context)
    for begin in range(0, n - 1, stride):
        x = ids[begin : min(begin + context, n - 1)]
        logp = torch.log_softmax(model(torch.tensor([x])).logits[0].double(), dim=-1)
        for j in range(len(x)):
            t = begin + j + 1
            if not done[t]:
                nll = -logp[j, ids[t]].item()
                total, done[t] = total + nll, True
                pos_nll[j] += nll
                pos_n[j] += 1
        if begin + context >= n - 1:
            break
    assert done.all(), "every token scored"
    return {"nll_sum": total, "tokens": n - 1, "pos_nll": pos_nll, "pos_n": pos_n}


def text_ids(root) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(root / "model")
    return [tok.bos_token_id] + tok((root / "eval.txt").read_text(), add_special_tokens=False)["input_ids"]


def shard_ids(root) -> list[int]:
    return [0] + shards.load_split(root / "shards", "test").tolist()


def check_against(got: dict, ref: dict, n_bytes: int, n_words: int, edges=()):
    assert got["tokens"] == ref["tokens"]
    assert got["nll"] == pytest.approx(ref["nll_sum"] / ref["tokens"], rel=REL)
    assert got["bits_per_byte"] == pytest.approx(ref["nll_sum"] / (n_bytes * math.log(2)), rel=REL)
    assert got["word_perplexity"] == pytest.approx(math.exp(ref["nll_sum"] / n_words), rel=REL)
    if edges:
        context = len(ref["pos_n"])
        bounds = [0, *[e for e in edges if e < context], context]
        for lo, hi in itertools.pairwise(bounds):
            bucket = got["buckets"][f"{lo}-{hi}"]
            assert bucket["tokens"] == ref["pos_n"][lo:hi].sum()
            assert bucket["nll"] == pytest.approx(ref["pos_nll"][lo:hi].sum() / ref["pos_n"][lo:hi].sum(), rel=REL)


SHARD_RUN = [
    "--models",
    "tiny=model",
    "--input",
    "shards",
    "--output",
    "out/shards",
    "contexts=[48,96]",
    "stride=20",
    "batch_size=3",
    "extrapolate=true",
    "position_buckets=[16,48]",
]


@pytest.fixture(scope="module")
def shard_run(assets):
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(assets)
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{assets / 'mlflow.db'}")
        return eval_perplexity.main(SHARD_RUN)


def test_non_overlapping_windows_match_reference_with_and_without_adapter(in_root):
    ids = text_ids(in_root)
    assert (len(ids) - 1) % 32 and (len(ids) - 1) % 64, "the text is not a multiple of the stride"
    metrics = eval_perplexity.main(
        [
            "--models",
            "base=model",
            "lora=model+adapter",
            "--text",
            "eval.txt",
            "--output",
            "out/text",
            "contexts=[32,64]",
            "stride=null",
            "batch_size=4",
        ]
    )
    text = (in_root / "eval.txt").read_text()
    n_bytes, n_words = len(text.encode()), len(text.split())
    assert (metrics["bytes"], metrics["words"]) == (n_bytes, n_words)
    for label, adapter in (("base", False), ("lora", True)):
        model = load(in_root, adapter)
        for context in (32, 64):
            check_against(
                metrics["models"][label][f"ctx{context}"], reference(model, ids, context, context), n_bytes, n_words
            )
    base, lora = (metrics["models"][k]["ctx64"]["nll"] for k in ("base", "lora"))
    assert abs(base - lora) > 1e-3 * base, "the adapter changes the model"

    out = in_root / "out/text"
    assert json.loads((out / "figures.json").read_text()) == json.loads(json.dumps(metrics))
    # the headline: each model's perplexity at the longest context
    assert json.loads((out / "metrics.json").read_text()) == {
        "perplexity": {k: metrics["models"][k]["ctx64"]["perplexity"] for k in ("base", "lora")}
    }
    rows = list(csv.DictReader(open(out / "table.csv")))
    assert {(r["model"], r["context"]) for r in rows} == {(m, c) for m in ("base", "lora") for c in ("32", "64")}
    row = next(r for r in rows if (r["model"], r["context"], r["metric"]) == ("lora", "32", "perplexity"))
    assert float(row["value"]) == pytest.approx(metrics["models"]["lora"]["ctx32"]["perplexity"], rel=1e-12)
    from PIL import Image

    assert Image.open(out / "plots" / "perplexity_vs_context.png").size[0] > 100
    lora_curve = (out / "plots/perplexity/lora.csv").read_text().splitlines()
    assert lora_curve[0] == "context,perplexity" and [r.split(",")[0] for r in lora_curve[1:]] == ["32", "64"]


def test_overlapping_windows_beyond_the_model_context_match_reference(shard_run, assets):
    ids = shard_ids(assets)
    assert (len(ids) - 1) % 20, "the split is not a multiple of the stride"
    meta = shards.read_meta(assets / "shards")["splits"]["test"]
    model = load(assets)
    for context in (48, 96):  # 96 > max_position_embeddings (extrapolate: true)
        ref = reference(model, ids, context, 20)
        check_against(shard_run["models"]["tiny"][f"ctx{context}"], ref, meta["bytes"], meta["words"], edges=(16, 48))
    short, long = (shard_run["models"]["tiny"][f"ctx{c}"]["nll"] for c in (48, 96))
    assert abs(short - long) > 1e-4 * short, "context lengths are told apart"


def test_two_processes_give_the_numbers_of_one(shard_run, assets):
    run_stage("eval_perplexity", [*SHARD_RUN[:5], "out/shards2", *SHARD_RUN[6:]], cwd=assets, nproc=2, **TRACKED)
    two = json.loads((assets / "out/shards2/figures.json").read_text())
    for context in ("ctx48", "ctx96"):
        one_m, two_m = shard_run["models"]["tiny"][context], two["models"]["tiny"][context]
        assert two_m["tokens"] == one_m["tokens"]
        for key in ("nll", "bits_per_byte", "word_perplexity", "byte_perplexity"):
            assert two_m[key] == pytest.approx(one_m[key], rel=REL)
        for name, bucket in one_m["buckets"].items():
            assert two_m["buckets"][name]["tokens"] == bucket["tokens"]
            assert two_m["buckets"][name]["nll"] == pytest.approx(bucket["nll"], rel=REL)

    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{assets / 'mlflow.db'}")
    runs = client.search_runs(
        [client.get_experiment_by_name("pipeline").experiment_id], filter_string="tags.world_size = '2'"
    )
    assert len(runs) == 1 and runs[0].data.tags["stage"] == "eval_perplexity" and runs[0].info.status == "FINISHED"
    history = client.get_metric_history(runs[0].info.run_id, "tiny.perplexity")
    assert sorted(m.step for m in history) == [48, 96]
    assert {a.path for a in client.list_artifacts(runs[0].info.run_id)} >= {
        "figures.json",
        "meta.json",
        "table.csv",
        "plots",
    }
    # The CPU the kernels were chosen for, with the results (meta.json) and on the run.
    cpu = runtime.cpu_info()
    assert runs[0].data.tags["cpu_capability"] == cpu["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert runs[0].data.tags["cpu_flags"] == ",".join(cpu["cpu_flags"])
    meta = json.loads((assets / "out/shards2/meta.json").read_text())
    assert meta["cpu"] == cpu and meta["compute_dtype"] == "torch.float32" and meta["world_size"] == 2


def test_bf16_precision_evaluates_near_fp32(shard_run, assets, monkeypatch):
    """precision: bf16 (weights and activations in bf16) on any CPU: emulated where the CPU lacks bf16
    instructions, so slower there, but the numbers are the same kind of close."""
    monkeypatch.chdir(assets)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{assets / 'mlflow.db'}")
    bf16 = eval_perplexity.main([*SHARD_RUN[:5], "out/bf16", *SHARD_RUN[6:], "precision=bf16"])
    for context in ("ctx48", "ctx96"):
        ours, fp32 = bf16["models"]["tiny"][context], shard_run["models"]["tiny"][context]
        assert ours["tokens"] == fp32["tokens"] and ours["nll"] != fp32["nll"], "bf16 rounds differently"
        assert ours["nll"] == pytest.approx(fp32["nll"], rel=2e-2)
    assert json.loads((assets / "out/bf16/meta.json").read_text())["compute_dtype"] == "torch.bfloat16"


def test_bits_per_byte_and_word_perplexity_by_hand(tmp_path, monkeypatch):
    """A byte-level tokenizer without merges (1 token per byte) and an lm_head of zeros: every token has
    NLL ln(258), so the totals can be written down by hand."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    tok = byte_bpe("abc\n", tmp_path, vocab_size=258)
    tokenize.save_hf_tokenizer(tok, tmp_path / "bytes")
    model = tiny_llama(258)
    torch.nn.init.zeros_(model.lm_head.weight)
    model.save_pretrained(tmp_path / "bytes")
    ci_params(tmp_path)
    text = "naïve cats sat\n"  # 16 bytes (ï is 2), 3 words
    (tmp_path / "t.txt").write_text(text)
    args = ["--models", "bytes", "--text", "t.txt", "--output", "out"]

    m = eval_perplexity.main([*args, "contexts=[8]", "prepend_bos=false"])["models"]["bytes"]["ctx8"]
    # 16 tokens, the first unscored: total NLL = 15 ln 258 over 16 bytes and 3 words.
    assert m["tokens"] == 15
    assert m["nll"] == pytest.approx(math.log(258), rel=REL)
    assert m["perplexity"] == pytest.approx(258, rel=REL)
    assert m["bits_per_byte"] == pytest.approx(15 / 16 * math.log2(258), rel=REL)
    assert m["byte_perplexity"] == pytest.approx(258 ** (15 / 16), rel=REL)
    assert m["word_perplexity"] == pytest.approx(258.0**5, rel=REL)

    # max_tokens=6 keeps "naïve" (6 bytes, 1 word); with bos first, all 6 tokens are scored.
    m = eval_perplexity.main([*args, "contexts=[4]", "stride=3", "max_tokens=6"])["models"]["bytes"]["ctx4"]
    assert m["tokens"] == 6
    assert m["bits_per_byte"] == pytest.approx(math.log2(258), rel=REL)
    assert m["word_perplexity"] == pytest.approx(258.0**6, rel=REL)


@pytest.fixture(scope="module")
def broken(assets):
    """Checkpoints that must be refused: vocab too small, config without weights, a sharded checkpoint
    without one of its shards, an adapter without its config."""
    root = assets / "broken"
    tiny_llama(200).save_pretrained(root / "small_vocab")
    tiny_llama(320).config.save_pretrained(root / "no_weights")
    tiny_llama(320).save_pretrained(root / "lost_shard", max_shard_size="100KB")
    (root / "lost_shard" / "model-00002-of-00005.safetensors").unlink()
    (root / "empty_adapter").mkdir()
    shutil.copytree(assets / "shards", root / "no_tokenizer", ignore=shutil.ignore_patterns("tokenizer"))
    return root


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["contexts=[128]"],
            "context 128 is longer than model 'tiny' was configured for (64 positions); "
            "set eval_perplexity.extrapolate: true",
        ),
        (["stride=0"], "eval_perplexity.stride must be between 1 and the smallest context (64), got 0"),
        (["contexts=[32,64]", "stride=33"], "eval_perplexity.stride must be between 1 and the smallest context (32)"),
        (["max_tokens=40"], "the split has 41 tokens, fewer than one window of context 64"),
        (
            ["--models", "tiny=broken/small_vocab"],
            "tokenizer vocab (320 ids) does not fit model 'tiny' (config.vocab_size 200)",
        ),
        (["--models", "tiny=broken/no_weights"], "broken/no_weights has no weights (model.safetensors"),
        (
            ["--models", "tiny=broken/lost_shard"],
            "lacks model-00002-of-00005.safetensors (listed in model.safetensors.index.json)",
        ),
        (["--models", "tiny=nowhere"], "--models tiny: nowhere not found"),
        (["--models", "tiny=model+broken/empty_adapter"], "broken/empty_adapter has no adapter_config.json"),
        (["split=val"], "no split 'val'"),
        (["--input", "broken/no_tokenizer"], "eval_perplexity: no tokenizer in broken/no_tokenizer/tokenizer"),
        (["contexts=[64,32]"], "eval_perplexity.contexts must be a non-empty list of increasing positive ints"),
        (["protocol=wikitext", "max_tokens=0"], "protocol wikitext evaluates a raw WikiText split; pass --text FILE"),
        (["protocol=wikitext", "stride=32"], "protocol wikitext scores whole documents in non-overlapping windows"),
        (
            ["protocol=wikitext", "max_tokens=0", "--text", "eval.txt"],
            "--text eval.txt: no line is a top-level WikiText heading",
        ),
        (["max_documents=3", "max_tokens=0"], "max_documents applies to protocol wikitext; use max_tokens"),
        (["protocol=harness"], "eval_perplexity.protocol must be stream or wikitext, got 'harness'"),
    ],
)
def test_clear_errors_before_any_compute(in_root, broken, args, message):
    base = ["--models", "tiny=model", "--input", "shards", "--output", "out/bad", "contexts=[64]", "extrapolate=false"]
    before = (in_root / "mlflow.db").stat().st_mtime_ns if (in_root / "mlflow.db").exists() else None
    with pytest.raises(config.UserError) as err:
        eval_perplexity.main([*base, *args])
    assert message in str(err.value)
    assert not (in_root / "out/bad").exists()
    after = (in_root / "mlflow.db").stat().st_mtime_ns if (in_root / "mlflow.db").exists() else None
    assert before == after, "no MLflow run was started"


def test_windows_score_every_token_once():
    for n, context, stride in ((10, 4, 4), (11, 4, 1), (5, 4, 3), (100, 16, 7)):
        plan = eval_perplexity.plan_windows(n, context, stride)
        targets = [b + 1 + j for b, length, first in plan for j in range(first, length)]
        assert sorted(targets) == list(range(1, n)), (n, context, stride)
        assert all(length == context for _, length, _ in plan[:-1])
        assert [first for _, _, first in plan[1:-1]] == [context - stride] * (len(plan) - 2)


def test_document_windows_score_each_token_of_a_document_once_after_a_full_context():
    for n, context in ((0, 4), (3, 4), (4, 4), (5, 4), (9, 4), (100, 16)):
        start = 7  # the document's prefix token is ids[7], its tokens ids[8 : 8 + n]
        plan = eval_perplexity.document_windows(start, n, context)
        targets = [b + 1 + j for b, length, first in plan for j in range(first, length)]
        assert sorted(targets) == list(range(start + 1, start + 1 + n)), (n, context)
        assert all(b >= start and b + length <= start + n for b, length, _ in plan), "inside the document"
        assert all(length == min(context, n) for _, length, _ in plan), "a full context wherever there is one"
        assert len(plan) == -(-n // context)


def test_a_rank_that_stops_in_an_evaluation_ends_the_stage_naming_it(shard_run, assets, tmp_path):
    """Rank 1 of 2 stops before its third batch and its whole process freezes (a fault injected: its own
    watchdog can no longer report); rank 0 finishes its windows and waits in the sum over ranks. The hang
    watchdog ends the stage after hang_timeout_s (5 s; a batch here takes milliseconds) instead of the
    1800 s collective timeout: rank 0's stacks in the log, rank 1, its host and where it was last seen named
    in the last line, exit 124 through the launcher, nothing published, the MLflow run FAILED with the cause
    tagged. (tests/test_pretrain.py's hang test has the stalled rank report its own stacks.)"""
    import re
    import socket
    import subprocess
    import sys

    import mlflow
    from conftest import stage_env

    from stages.common import watchdog

    out = tmp_path / "stalled"
    args = [*SHARD_RUN[:5], str(out), *SHARD_RUN[6:], "hang_timeout_s=5"]
    env = stage_env(assets, PIPELINE_NPROC_PER_NODE="2", PIPELINE_FAULT_STALL="1:2:frozen", **TRACKED)
    cmd = [sys.executable, "-m", "pipelines.launch", "eval_perplexity", *args]
    # (timeout: the guard against the collective timeout this test is about)
    proc = subprocess.run(cmd, cwd=assets, env=env, capture_output=True, text=True, timeout=180)
    log = proc.stdout + proc.stderr
    assert proc.returncode == watchdog.HANG_EXIT, log[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    where = r"\(last seen after batch 2 of \d+ \(tiny, context 48\); it sent no report\)"
    host = re.escape(socket.gethostname())
    assert re.match(rf"error: hang: rank 1 on {host} {where} made no progress for \d+ s", last), last
    rank0 = log.index("[rank 0] ")
    assert "[rank 1] " not in log and "(no report from rank(s) 1 within" in log[rank0:], log[rank0:]
    assert "waits in a collective; Python stacks:" in log[rank0:] and "in evaluate" in log[rank0:], log[rank0:]
    assert not out.exists()
    client = mlflow.MlflowClient(f"sqlite:///{assets / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("pipeline").experiment_id
    (run,) = client.search_runs([experiment], "tags.stage = 'eval_perplexity' and attributes.status = 'FAILED'")
    assert run.data.tags["failure"] == "hang" and "rank 1 on" in run.data.tags["failure_cause"]
