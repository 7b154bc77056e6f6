"""The planner's node path (planner/node_path.py, docs/DISTRIBUTED.md) and ZeRO-3 offload on a node
(planner/zero3_node.py): the issue's figures as `megatrain plan` prints them, and the mechanism behind them."""

from __future__ import annotations

import json
import re

import pytest

from megatrain.planner import get_hardware
from megatrain.planner.cli import main  # `python -m megatrain.planner`, the plan command's first screen
from megatrain.planner.multi import node_memory, plan_auto_multi, plan_multi, plan_point_multi
from megatrain.planner.node_path import NODE, PER_RANK, NodeShare, node_share, path_for
from megatrain.planner.point import make_point
from megatrain.planner.summary import FIRST_SCREEN_LINES

POINT = ["--context", "4096", "--batch", "1"]
QWEN3_235B = {  # Qwen3-235B-A22B's shapes (its config.json's keys)
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096, "num_hidden_layers": 94,
    "num_experts": 128, "moe_intermediate_size": 1536, "num_experts_per_tok": 8, "num_attention_heads": 64,
    "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
}


def _screen(capsys, *args: str) -> list[str]:
    assert main(["--model", *args]) == 0
    return capsys.readouterr().out.splitlines()


def _figure(lines: list[str], pattern: str) -> float:
    for line in lines:
        m = re.search(pattern, line)
        if m:
            return float(m.group(1).replace(",", ""))
    raise AssertionError(f"{pattern!r} not in:\n" + "\n".join(lines))


def _step_s(lines: list[str]) -> float:
    return _figure(lines, r"^  step ([\d.]+) s")


@pytest.mark.parametrize("model", ["llama3.1-70b", "qwen2.5-32b"])
def test_an_8_gpu_h100_node_scales_and_beats_zero3_there(capsys, model):
    lines = _screen(capsys, model, *POINT, "--hardware", "h100-sxm", "--gpus-per-node", "8")
    assert len(lines) <= FIRST_SCREEN_LINES
    assert _figure(lines, r"scaling: efficiency ([\d.]+)%") >= 85
    assert any(line.startswith("  data path: node:") and "no GPU has run it" in line for line in lines)
    assert _figure(lines, r"megatrain/zero3 = ([\d.]+)x") >= 1.5
    # ZeRO-3 itself at that point plans (it used to be refused), and its throughput is the one compared with
    z = _screen(capsys, model, *POINT, "--hardware", "h100-sxm", "--gpus-per-node", "8", "--backend", "zero3")
    assert z[0].startswith("zero3 plan:") and "  fits: yes" in z
    ours = _figure(lines, r"job ([\d,]+) tokens/s")
    theirs = _figure(z, r"job ([\d,]+) tokens/s")
    assert ours / theirs == pytest.approx(_figure(lines, r"megatrain/zero3 = ([\d.]+)x"), rel=0.01)


def test_the_same_node_on_todays_per_rank_path_does_not_scale():
    """The negative control: what the efficiency comes from is the path. Every rank streaming every layer from its
    share of the host (the per-rank path) stays far below; the node path's GPUs each move 1/8 of a layer's bytes."""
    node = plan_multi("llama3.1-70b", 4096, 1, hardware="h100-sxm", gpus_per_node=8)
    per_rank = plan_multi("llama3.1-70b", 4096, 1, hardware="h100-sxm", gpus_per_node=8, data_path="per-rank")
    assert node.path == NODE and per_rank.path == PER_RANK
    assert per_rank.scaling_efficiency < 0.5 < 0.85 <= node.scaling_efficiency
    # the streamed layers' bytes over each GPU's own link: 1/8 of the per-rank path's weight loads
    p = node.rank.point
    loads = p.model.layer_params() * p.c
    share = node_share(get_hardware("h100-sxm"), 8)
    assert share.link_fraction == pytest.approx(1 / 8) and share.nvlink_fraction == pytest.approx(7 / 8)
    assert node.rank.time.h2d_bytes < per_rank.rank.time.h2d_bytes / 4
    assert node.rank.time.busy_s["NVLink"] > 0 and "NVLink" not in per_rank.rank.time.busy_s
    assert node.rank.time.layer.fwd_h2d == pytest.approx(share.weights_s(p.model.layer_params(), p.c,
                                                                         node.rank.hardware.link_bps))
    assert loads * share.link_fraction / node.rank.hardware.link_bps < node.rank.time.layer.fwd_h2d + 1e-12


def test_nvlink_domains_and_nodes_without_nvlink():
    # an H200 NVL node: 4-way bridges, so an 8-card node gathers the other domain's half over PCIe
    nvl = node_share(get_hardware("h200-pcie"), 8)
    assert nvl.domain == 4 and nvl.link_fraction == pytest.approx(1 / 8 + 1 / 8) and nvl.nvlink_fraction == 0.75
    # PCIe cards without NVLink keep the per-rank path, and the plan says why
    path, why = path_for(get_hardware("h100-pcie"), 8)
    assert path == PER_RANK and "no NVLink" in why
    assert path_for(get_hardware("h100-sxm"), 1)[0] == PER_RANK
    # NVLink is one resource for the two collectives: half its rate each
    s = NodeShare(8, 8, 100e9)
    assert s.weights_s(10**9, 2, 1e15) == pytest.approx(2e9 * 7 / 8 / 50e9)


def test_pcie_node_first_screen_names_the_per_rank_path(capsys):
    lines = _screen(capsys, "qwen2.5-32b", *POINT, "--hardware", "h100-pcie", "--gpus-per-node", "8", "--compare", "")
    path = next(line for line in lines if line.startswith("  data path:"))
    assert "per-rank" in path and "no NVLink" in path and "what the engine runs" in path
    assert any("GPUs joined by NVLink take the node path" in line for line in lines)


def test_dense_120b_fits_an_8_gpu_h200_pcie_node(capsys):
    lines = _screen(capsys, "120b", *POINT, "--hardware", "h200-pcie", "--gpus-per-node", "8")
    assert len(lines) <= FIRST_SCREEN_LINES
    fit = next(line for line in lines if line.startswith("  fits:"))
    assert fit.startswith("  fits: yes")
    # the verdict is host mode "auto"'s for the node: its host bytes (after any spill) within the node's
    host = re.search(r"memory: host ([\d.]+) TiB of ([\d.]+) TiB per node", "\n".join(lines))
    assert host and float(host.group(1)) <= float(host.group(2))


def test_json_names_the_path_and_the_choice(capsys):
    assert main(["--model", "llama3.1-70b", *POINT, "--hardware", "h100-sxm", "--gpus-per-node", "8", "--json",
                 "--no-search"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["data_parallel"]["data_path"] == NODE and d["auto"]["fits"] and d["data_parallel"]["fits"]
    assert d["compare"][0]["data_path"] == "zero3" and d["compare"][0]["fits"]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3-235b-a22b")
    (d / "config.json").write_text(json.dumps(QWEN3_235B))
    return str(d)


def test_qwen3_235b_one_h200_first_screen_headline_has_the_nvme_time(capsys, qwen3):
    lines = _screen(capsys, qwen3, *POINT, "--hardware", "h200-pcie")
    assert len(lines) <= FIRST_SCREEN_LINES and all(len(line) <= 400 for line in lines)
    assert "NVMe" in next(line for line in lines if line.startswith("  fits:"))
    headline = _step_s(lines)
    # the details' NVMe table gives the chosen mode's step: the headline is that, not the pipeline's alone
    details = _screen(capsys, qwen3, *POINT, "--hardware", "h200-pcie", "--details", "--no-search")
    chosen = re.search(r'"host_master": "(\w+)", "host_grad_dtype": "(\w+)"', "\n".join(lines)).groups()
    label = {("hilo", "bfloat16"): "hilo master, bf16 grads", ("hilo", "float32"): "hilo master, fp32 grads",
             ("fp32", "float32"): "fp32 master, fp32 grads"}[chosen]
    row = next(line for line in details if line.strip().startswith(f"{label} + NVMe "))
    table_step = float(re.search(r"([\d.]+)s\s+yes", row).group(1))
    assert headline == pytest.approx(table_step, abs=0.06)
    pipeline = _figure(details, r"^  step ([\d.]+) s \+ NVMe")
    assert headline > pipeline + 1.0  # the NVMe time is in it
    # every "fits" of the details agrees with the first screen's
    fits = {line.strip() for line in details if line.strip().startswith("fits:")}
    assert fits == {next(line for line in lines if line.startswith("  fits:")).strip()}


def test_qwen3_235b_on_4_nodes_fits_in_memory_and_beats_the_nvme_plan(capsys, qwen3):
    one = _step_s(_screen(capsys, qwen3, *POINT, "--hardware", "h200-pcie", "--compare", ""))
    lines = _screen(capsys, qwen3, *POINT, "--hardware", "h200-pcie", "--nodes", "4", "--compare", "")
    assert len(lines) <= FIRST_SCREEN_LINES
    fit = next(line for line in lines if line.startswith("  fits:"))
    assert fit.startswith("  fits: yes") and "NVMe" not in fit
    assert "4 nodes share one store" in "\n".join(lines)
    assert _step_s(lines) < one


def test_a_model_no_node_holds_gets_the_fewest_nodes_and_a_point_that_does_not_fit_no_throughput(capsys):
    # llama3.1-70b on an h100-pcie host cut to 512 GiB, no NVMe disk in that profile: no fit on one node
    lines = _screen(capsys, "llama3.1-70b", *POINT, "--hardware", "h100-pcie", "--host-memory-gib", "512",
                    "--compare", "")
    assert next(line for line in lines if line.startswith("  fits:")).startswith("  fits: NO")
    assert any(line.startswith("  step: none") for line in lines)
    assert not any("tokens/s" in line for line in lines)
    hint = next(line for line in lines if "--nodes" in line)
    n = int(re.search(r"--nodes (\d+)", hint).group(1))
    # that count fits and one fewer does not
    p = make_point("llama3.1-70b", 4096, 1, 1, "bfloat16", "megatrain", host_master="fp32", host_grad_dtype="float32")
    hw = get_hardware("h100-pcie").with_(host_memory_gib=512.0)
    assert plan_auto_multi(p, hw, 1, n).fits
    if n > 2:
        assert not plan_point_multi(p, hw, 1, n - 1, n - 1).rank.feasible


def test_nodes_sharing_a_store_hold_their_share_of_the_layers():
    pl = plan_multi("llama3.1-70b", 4096, 1, hardware="h200-pcie", gpus_per_node=8, nodes=2)
    L = pl.single.point.model.num_layers
    whole = node_memory(pl.single, 8, 2, NODE, 1)[1]
    half = node_memory(pl.single, 8, 2, NODE, 2)[1]
    assert half["adam m"] == int(whole["adam m"] * (L // 2) / L) and half["runtime"] == whole["runtime"]


def test_zero3_on_a_node_moves_1_over_g_of_the_bytes_over_each_link():
    p = make_point("qwen2.5-32b", 4096, 1, 1, "bfloat16", "zero3")
    hw = get_hardware("h100-sxm")
    one = plan_point_multi(p, hw, 1, 1)
    eight = plan_point_multi(p, hw, 8, 1)
    assert eight.rank.time.h2d_bytes == pytest.approx(one.rank.time.h2d_bytes / 8, rel=1e-6)
    assert eight.path == "zero3" and "NVLink" in eight.path_why
    # its CPU Adam: one model's update on the node either way (each rank 1/8 at 1/8 of the host)
    assert eight.rank.time.optimizer_s == pytest.approx(one.rank.time.optimizer_s, rel=1e-6)


def test_json_headline_is_the_first_screens(capsys, qwen3):
    lines = _screen(capsys, qwen3, *POINT, "--hardware", "h200-pcie", "--compare", "")
    assert main(["--model", qwen3, *POINT, "--hardware", "h200-pcie", "--compare", "", "--json", "--no-search"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["headline_step_s"] == pytest.approx(_step_s(lines), abs=0.006)
    assert d["headline_step_s"] > d["time"]["step_s"]  # the NVMe time is in the headline, not in the pipeline's step
    tight = ["--model", "llama3.1-70b", *POINT, "--hardware", "h100-pcie", "--host-memory-gib", "512", "--compare", ""]
    assert main([*tight, "--json", "--no-search"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] is False and d["headline_step_s"] is None and d["headline_tokens_per_s"] is None


@pytest.mark.parametrize("args", [
    ["tiny", "--context", "128", "--hardware", "cpu"],
    ["llama2-7b", "--hardware", "rtx4090", "--compare", "zero3,torch,zero3-alst"],
    ["gpt-oss-120b", "--hardware", "h200-pcie", "--gpus-per-node", "4"],
    ["llama3.1-70b", "--hardware", "h100-pcie", "--gpus-per-node", "8", "--nodes", "2"],
    ["qwen2.5-14b", "--hardware", "gh200", "--gpus-per-node", "4", "--backend", "zero3"],
])
def test_first_screen_is_short_and_claims_no_throughput_without_a_fit(capsys, args):
    lines = _screen(capsys, *args)
    assert 0 < len(lines) <= FIRST_SCREEN_LINES and all(len(line) <= 400 for line in lines)
    fit = next(line for line in lines if line.startswith("  fits:"))
    if fit.startswith("  fits: NO"):
        assert not any("tokens/s" in line and not line.lstrip().startswith("zero3") for line in lines)
    else:
        assert any(line.startswith("  step ") for line in lines)


def test_node_details_agree_with_the_first_screen(capsys):
    args = ["120b", *POINT, "--hardware", "h200-pcie", "--gpus-per-node", "8", "--compare", ""]
    first = _screen(capsys, *args)
    details = _screen(capsys, *args, "--details", "--no-search")
    assert details[: len(first)] == first  # the first screen, then the rest
    fits = {line.strip() for line in details if line.strip().startswith("fits:")}
    assert fits == {next(line for line in first if line.startswith("  fits:")).strip()}
    assert _figure(details, r"step per rank ([\d.]+) s") == pytest.approx(_step_s(first), abs=0.006)


def test_a_grace_hopper_node_has_a_host_per_gpu():
    from megatrain.planner.multi import node_profile

    one = get_hardware("gh200")
    four = node_profile(one, 4)
    assert four.host_bytes == 4 * one.host_bytes and four.host_bw_bps == pytest.approx(4 * one.host_bw_bps)
    assert node_profile(get_hardware("h100-sxm"), 8) == get_hardware("h100-sxm")  # one host for the board
