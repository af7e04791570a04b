"""CPU smoke tests of the benchmark harness (specsample.bench) at tiny sizes, torch backend."""

from __future__ import annotations

import json

import pytest
import torch

from specsample import bench, verify

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "torch")


def test_quick_run_writes_table_json_and_plot(tmp_path, capsys):
    argv = ["--device", "cpu", "--out", str(tmp_path), "--repeats", "1", "--batch-sizes",
            "1,2", "--vocab", "512", "--k", "3", "--sample-batch-sizes", "1,2",
            "--sample-vocab", "1024", "--temperatures", "0.7,mix", "--options",
            "T0.6+p0.9,lp5-raw", "--block", "--draft-counts", "varying,device",
            "--option-drafts", "onehot,draft_logits"]
    assert bench.main(argv) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    cases = report["cases"]
    # verify (kind x T x B) + sample (T x B) + --block (token draft_probs, block draft_logits
    # and draft_probs: 3 x T x B) + draft counts (2 x B) + two option cases (verify one-hot,
    # draft logits token and block x B, sample x B)
    assert len(cases) == 2 * 2 * 2 + 2 * 2 + 3 * 2 * 2 + 2 * 2 + 2 * (3 * 2 + 2)
    opt = {(c["draft"], c["method"]) for c in cases if c["options"] and c["op"] == "verify"}
    assert opt == {("onehot", "token"), ("draft_logits", "token"), ("draft_logits", "block")}
    lp = [c for c in cases if c["options"] == "lp5-raw"]
    assert lp and all(c["baseline"]["eager_us"] > 0 for c in lp)  # the torch baseline
    varying = [c for c in cases if c["counts"] == "varying"]
    assert [c["rows"] for c in varying] == [1, 1 + 2]  # k_i = i mod (K + 1)
    assert report["copy_bandwidth_bytes_per_s"] > 0
    assert report["environment"]["pdl"] is False  # (CPU: no programmatic dependent launch)
    for case in cases:
        for variant in ("fused", "unfused"):
            assert case[variant]["error"] is None, case[variant]["error"]
            assert case[variant]["eager_us"] > 0
            assert case[variant]["graph_us"] is None  # no graph replay on CPU
        assert case["floor_us"] > 0 and case["ratio_to_floor"] > 0
        assert case["targets"] == []  # GPU targets are not judged on CPU
        expected = "torch.sample" if case["op"] == "sample" else f"torch.verify.{case['draft']}"
        assert case["fused"]["paths"][expected]["calls"] >= 2
        assert case["unfused"]["paths"][expected]["calls"] >= 2
    dl = [c for c in cases if c["draft"] in ("draft_logits", "draft_probs")]
    assert all(c["floor_target_us"] >= c["floor_us"] for c in dl)
    assert {c["method"] for c in dl} == {"token", "block"}
    printed = capsys.readouterr().out
    assert "verify/onehot/T=0.7/B=2" in printed and "sample/sample/T0.6+p0.9/B=2" in printed
    pytest.importorskip("matplotlib")
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_unknown_option_draft_kind_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--out", str(tmp_path), "--option-drafts", "tree"])
    assert "unknown draft kind" in capsys.readouterr().err


def test_profile_lists_where_each_case_spends_its_time(tmp_path):
    argv = ["--device", "cpu", "--out", str(tmp_path), "--repeats", "1", "--batch-sizes", "2",
            "--vocab", "512", "--sample-batch-sizes", "1", "--sample-vocab", "1024",
            "--temperatures", "0.7", "--no-unfused", "--options", "none", "--profile"]
    assert bench.main(argv) == 0  # (the option cases would add 40 s on a CI core)
    cases = json.loads((tmp_path / "bench.json").read_text())["cases"]
    for case in cases:
        prof = case["fused"]["kernel_us"]
        assert prof and all(us > 0 for us in prof.values())
        assert list(prof.values()) == sorted(prof.values(), reverse=True)
        assert any(name.startswith("aten::") for name in prof)  # CPU: the operators
    text = (tmp_path / "kernel_profile.txt").read_text()
    assert "verify/onehot/T=0.7/B=2" in text and " us  aten::" in text


def test_zipf_logits_are_peaked_with_a_long_tail():
    gen = torch.Generator().manual_seed(0)
    x = bench.zipf_logits(16, 151936, dtype=torch.bfloat16, device=CPU, generator=gen)
    assert x.dtype == torch.bfloat16 and x.shape == (16, 151936)
    p = torch.softmax(x.float(), dim=-1)
    top = p.max(dim=-1).values
    assert bool((top > 0.25).all()) and bool((top < 0.95).all())
    assert len(set(x.float().argmax(-1).tolist())) > 8  # the top token moves between rows


def test_onehot_drafts_pick_the_top_token_about_70_percent():
    gen = torch.Generator().manual_seed(1)
    rows = bench.zipf_logits(2000, 256, dtype=torch.float32, device=CPU, generator=gen)
    drafts = bench.onehot_drafts(rows, gen)
    frac = (drafts == rows.argmax(-1)).float().mean().item()
    assert 0.65 < frac < 0.78


def test_noop_bias_takes_the_general_path_and_changes_nothing():
    case = bench.Case("verify", "draft_logits", "mix", 4, 3, 300, "float32")
    inp = bench.build_inputs(case, CPU)
    assert not inp.batch.needs_general_path and inp.general_batch.needs_general_path
    kw = {"draft_logits": inp.draft_logits, "positions": inp.positions}
    a = verify(inp.logits, inp.drafts, inp.num_draft, inp.batch, **kw)
    b = verify(inp.logits.float(), inp.drafts, inp.num_draft, inp.general_batch, **kw)
    assert torch.equal(a.token_ids, b.token_ids)


def test_floor_counts_second_reads_of_rejected_rows_only_with_draft_logits():
    for draft in ("onehot", "draft_logits"):
        case = bench.Case("verify", draft, "1.0", 2, 4, 128, "bfloat16")
        inp = bench.build_inputs(case, CPU)
        once, extra = bench.floor_bytes(case, inp, rejected_sampled=1)
        rows = 2 * 5 + (2 * 4 if draft == "draft_logits" else 0)
        assert once == rows * 128 * 2
        assert extra == (2 * 128 * 2 if draft == "draft_logits" else 0)


def test_forbidden_paths_split_fused_and_general_on_triton_only():
    assert bench.forbidden_paths("torch", "fused") == ()
    assert "triton.*.general" in bench.forbidden_paths("triton", "fused")
    unfused = bench.forbidden_paths("triton", "unfused")
    assert {"triton.verify.fused", "triton.sample.fused", "triton.processing.fused"} <= set(
        unfused)
    assert "triton.logprobs.fused" not in unfused  # (the general path's logprob kernels)


def test_specsample_bench_command_is_registered():
    from specsample import cli

    args = cli.build_parser().parse_args(["bench", "--quick", "--batch-sizes", "1,8"])
    assert args._run is bench.run_bench and args.batch_sizes == [1, 8] and args.quick


def test_full_sizes_on_a_cpu_need_asking_for(tmp_path, capsys, monkeypatch):
    # (a new user's `specsample bench` without a GPU ran full-size cases for 11 minutes)
    from specsample import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    assert bench.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "--cpu-check" in err and "--device cpu" in err
    assert cli.main(["bench", "--out", str(out)]) == 2  # (the `specsample bench` command)
    assert "no CUDA device" in capsys.readouterr().err
    assert not out.exists()  # (nothing written)


def test_cpu_check_reports_the_ratio():
    cases = (("T0.8 top_p", 2, 1024, False, {"temperature": 0.8, "top_p": 0.9}, 5.0),
             ("sample", 3, 1024, True, {"temperature": 0.8}, None))
    res = bench.cpu_check(1, k=2, cases=cases)
    assert [r["shape"] for r in res] == [[6, 1024], [3, 1024]]
    for r in res:
        assert r["ms"] > 0 and r["softmax_ms"] > 0 and r["ratio"] > 0
    assert res[1]["limit_ms"] == bench.CPU_SAMPLE_LIMIT_MS


def test_tree_shape_is_breadth_first_4_then_2():
    assert bench.tree_shape(16) == [0] * 4 + [1, 1, 2, 2, 3, 3, 4, 4] + [5, 5, 6, 6]
    p64 = bench.tree_shape(64)
    assert len(p64) == 64 and all(0 <= p < n for n, p in enumerate(p64, start=1))
    assert p64[:4] == [0] * 4 and p64[60:] == [29, 29, 30, 30]  # 4 + 8 + 16 + 32, then 4


def test_quick_run_with_trees(tmp_path, capsys):
    argv = ["--device", "cpu", "--out", str(tmp_path), "--repeats", "1", "--batch-sizes",
            "1,2", "--vocab", "512", "--sample-batch-sizes", "1", "--sample-vocab", "1024",
            "--temperatures", "1.0", "--options", "none", "--trees", "--quick"]
    assert bench.main(argv) == 0
    cases = json.loads((tmp_path / "bench.json").read_text())["cases"]
    trees = [c for c in cases if c["op"] == "verify_tree"]
    chains = [c for c in cases if c["shape"] == "chain"]
    assert [(c["k"], c["batch"]) for c in trees] == [(16, 1), (16, 2), (64, 1), (64, 2)]
    assert [(c["k"], c["batch"]) for c in chains] == [(16, 1), (16, 2), (64, 1), (64, 2)]
    for tree, chain in zip(trees, chains, strict=True):
        # the same target rows: M + 1 per request, so the same floor
        assert tree["rows"] == chain["rows"] == tree["batch"] * (tree["k"] + 1)
        assert tree["bytes_read_once"] == chain["bytes_read_once"] == tree["rows"] * 512 * 2
        assert chain["fused"]["paths"]["torch.verify.onehot"]["calls"] >= 2
        for variant in ("fused", "unfused"):
            assert tree[variant]["error"] is None, tree[variant]["error"]
            assert tree[variant]["paths"]["torch.verify_tree.onehot"]["calls"] >= 2
        assert tree["mean_accepted"] >= 0 and tree["ratio_to_floor"] > 0
    assert "verify_tree/onehot+tree64/T=1.0/B=2" in capsys.readouterr().out
