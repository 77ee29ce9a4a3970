"""moe_comparison: the mixture runs the dense model's active weights (plus its routers) and
differs from it only in its feed-forward layers; trained on the CPU clock with balancing_loss it
keeps its budget, adds the load-balancing loss and lowers the loss; expert_load counts real
tokens; records merge; the shipped record holds both runs at the same CPU time; bad names are
refused."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import bad_command_line, raises
from transformer_tutorial import data
from transformer_tutorial.experiments.harness import train_for
from transformer_tutorial.experiments.moe_comparison import (
    COMPARED,
    active_parameters,
    balancing_loss,
    comparison_config,
    expert_load,
    load_comparison_record,
    main,
)
from transformer_tutorial.lm.config import LMConfig
from transformer_tutorial.lm.model import LanguageModel

V = 40


def sentences(n: int, seed: int = 0) -> list[list[int]]:
    """``<bos>`` and a run of counting tokens ``<eos>``: easy to learn."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        start = torch.randint(4, 20, (1,), generator=g).item()
        rows.append([data.BOS_ID, *range(start, start + 6), data.EOS_ID])
    return rows


def test_the_mixture_runs_the_dense_models_active_weights():
    dense, sparse = (comparison_config(name, 2000) for name in ("dense", "moe"))
    with torch.device("meta"):
        models = [LanguageModel(c) for c in (dense, sparse)]
    active = [active_parameters(m) for m in models]
    assert active[0] == models[0].num_parameters()  # a dense model runs every weight
    assert active[1] - active[0] == sparse.n_layers * sparse.n_experts * sparse.d_model  # routers
    assert models[1].num_parameters() > 2 * models[0].num_parameters()
    moe_only = {"n_experts", "n_experts_per_token", "moe_d_ff", "norm_topk_prob"}
    differ = {k for k in vars(dense) if getattr(dense, k) != getattr(sparse, k)}
    assert differ == moe_only | {"router_aux_loss_coef"}


def train_for_cpu(model, train, val, *, cpu_seconds, **kwargs):
    """How run_one trains a side: on the CPU clock, with the load-balancing loss."""
    coef = model.config.router_aux_loss_coef
    return train_for(
        model,
        train,
        val,
        seconds=cpu_seconds,
        clock="cpu",
        aux_loss=balancing_loss,
        aux_weight=coef,
        **kwargs,
    )


def test_trained_on_cpu_time_it_keeps_its_budget_adds_the_aux_loss_and_lowers_the_loss():
    torch.manual_seed(0)
    config = LMConfig(vocab_size=V, **(COMPARED["moe"] | dict(max_len=16)))
    model = LanguageModel(config)
    train, val = sentences(64), data.pad_batch(sentences(8, seed=1))
    load = expert_load(model, val)
    assert torch.tensor(load).sum(1).tolist() == [2 * int((val != data.PAD_ID).sum())] * 2
    out = train_for_cpu(model, train, val, cpu_seconds=3.0, evaluations=3, max_tokens=128)
    assert 3.0 <= out["cpu_seconds"] < 3.0 + 1.0 and len(out["val"]) == 4
    assert out["val"][-1][2] < out["val"][0][2] - 0.5
    assert all(a is not None and a >= 1.99 for a in out["aux"])  # k = 2 at best
    dense = LanguageModel(LMConfig(vocab_size=V, **(COMPARED["dense"] | dict(max_len=16))))
    assert train_for_cpu(dense, train, val, cpu_seconds=0.5, evaluations=1)["aux"] == [None]


def test_records_merge(tmp_path):
    for name in ("dense", "moe"):
        record = {"command": [name], "hardware": {"cpu": name}, "torch": "x", "runs": {name: 1}}
        (tmp_path / f"{name}.json").write_text(json.dumps(record))
    out = tmp_path / "both.json"
    main(["--merge", str(tmp_path / "dense.json"), str(tmp_path / "moe.json"), "--out", str(out)])
    merged = json.loads(out.read_text())
    assert merged["commands"] == [["dense"], ["moe"]] and merged["runs"] == {"dense": 1, "moe": 1}
    assert [h["cpu"] for h in merged["hardware"]] == ["dense", "moe"]


def test_the_shipped_record_holds_both_runs_at_the_same_cpu_time():
    record = load_comparison_record()
    runs = record["runs"]
    assert set(runs) == {"dense", "moe"}
    assert abs(runs["moe"]["cpu_seconds"] / runs["dense"]["cpu_seconds"] - 1) < 0.01
    assert runs["dense"]["load_before"] is None and len(runs["moe"]["load_after"]) == 2


def test_bad_names_are_refused():
    raises(lambda: comparison_config("sparse", 2000), ValueError, "name must be one of")


def sigmoid_model() -> LanguageModel:
    """COMPARED["moe"] with DeepSeek-V3's router, its correction bias sending every token to
    experts 0 and 1."""
    changes = dict(max_len=16, router="sigmoid", norm_topk_prob=True)
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=V, **(COMPARED["moe"] | changes)))
    for layer in model.layers:
        layer.ff.correction_bias[:2] = 5.0
    return model


def test_expert_load_of_a_sigmoid_router_counts_the_experts_it_chose():
    """The softmax top-k of its logits ignores the bias: every token went to 0 and 1."""
    val = data.pad_batch(sentences(8, seed=1))
    real = int((val != data.PAD_ID).sum())
    for layer_load in expert_load(sigmoid_model(), val):
        assert layer_load[:2] == [real, real] and sum(layer_load) == 2 * real


def test_balancing_loss_refuses_a_sigmoid_router_and_leaves_it_untrained():
    model = sigmoid_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train, val = sentences(8), data.pad_batch(sentences(4, seed=1))
    call = lambda: train_for_cpu(model, train, val, cpu_seconds=0.5)  # noqa: E731
    raises(call, ValueError, "router='sigmoid': the load-balancing loss is the softmax router's")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


# --- the command line (issue 42): a bad flag is one line and exit status 2, never a traceback --


def record_of(tmp_path, text: str) -> str:
    path = tmp_path / "record.json"
    path.write_text(text)
    return str(path)


MOE_CLI_PROBES = {  # name: (argv from tmp_path, the line)
    "--merge of a missing file": (
        lambda tmp: ["--merge", str(tmp / "missing.json"), "--out", str(tmp / "o.json")],
        "error: argument --merge: cannot read",
    ),
    "--merge of a record without runs": (
        lambda tmp: ["--merge", record_of(tmp, '{"command": []}'), "--out", str(tmp / "o.json")],
        "error: argument --merge:",
    ),
    "--out a folder": (
        lambda tmp: ["--model", "moe", "--out", str(tmp)],
        "error: argument --out:",
    ),
}


@pytest.mark.parametrize(("argv", "line"), MOE_CLI_PROBES.values(), ids=MOE_CLI_PROBES.keys())
def test_a_bad_flag_is_one_line_and_exit_status_2(capsys, tmp_path, argv, line):
    bad_command_line(capsys, main, argv(tmp_path), line)
