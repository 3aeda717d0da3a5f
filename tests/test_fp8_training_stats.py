"""benchmarks/fp8_training.py's statistics over seeds (issue 12's loss targets are judged on them):
numbers computed by hand."""

import pytest

from benchmarks import fp8_training as bench

TORCH = bench.TORCH


def test_gap_of_the_mean_loss_two_standard_errors_and_drift_by_hand():
    per_seed = [
        {"exact fp8": 2.0, "fp8_cache=act_input": 2.02, TORCH: 1.99},
        {"exact fp8": 4.0, "fp8_cache=act_input": 3.96, TORCH: 4.02},
    ]
    st = bench.cache_stats(per_seed)
    # mean losses 3.0, 2.99 and 3.005: the gap of the means, not the mean of the gaps (which is 0)
    assert st.mean["fp8_cache=act_input"] == pytest.approx(2.99)
    assert st.gap["fp8_cache=act_input"] == pytest.approx(0.01 / 3)
    assert st.torch_gap["fp8_cache=act_input"] == pytest.approx(0.005 / 3)
    # signed per-seed gaps +1% and -1%: drift 1%, stdev sqrt(2)%, two SE 2 * sqrt(2)% / sqrt(2)
    assert st.drift["fp8_cache=act_input"] == pytest.approx(0.01)
    assert st.two_se["fp8_cache=act_input"] == pytest.approx(0.02)
    assert st.gap["exact fp8"] == 0 and st.two_se["exact fp8"] == 0
    # paired differences to torch's pass: +1.5% and -1.5%: mean 0, two SE 3%
    mean, two_se = st.vs_torch["fp8_cache=act_input"]
    assert mean == pytest.approx(0) and two_se == pytest.approx(0.03)
    checks = dict(bench.cache_checks(st))
    assert [ok for text, ok in checks.items() if "within 0.25%" in text] == [False]  # 0.333%
    assert [ok for text, ok in checks.items() if "below torch's" in text] == [False]  # 0.333% vs 0.167%


def test_runs_of_other_seeds_are_judged_on_their_own_seeds():
    per_seed = [{"exact fp8": 2.0, "fp8_cache=all": 2.0, TORCH: 2.2},
                {"exact fp8": 4.0, "fp8_cache=all": 4.04, TORCH: 4.0},
                {"exact fp8": 3.0, TORCH: 3.03}]
    st = bench.cache_stats(per_seed)
    assert st.n == {"exact fp8": 3, "fp8_cache=all": 2, TORCH: 3}
    assert st.gap["fp8_cache=all"] == pytest.approx(6.04 / 6 - 1)  # seeds 0 and 1 only
    assert st.torch_gap["fp8_cache=all"] == pytest.approx(6.2 / 6 - 1)  # the same two seeds
    assert st.gap[TORCH] == pytest.approx(9.23 / 9 - 1)
    assert dict(bench.cache_checks(st))[
        f"fp8_cache=all gap below torch's pass's ({6.04 / 6 - 1:.3%} vs {6.2 / 6 - 1:.3%})"]
    assert bench.cache_stats(per_seed[:1]).two_se["fp8_cache=all"] is None


def test_merge_joins_runs_of_a_seed_and_refuses_disagreeing_files():
    a = {"seeds": [0, 1], "losses": [{"exact fp8": 2.0, TORCH: 2.1}, {"exact fp8": 3.0, TORCH: 3.1}]}
    b = {"seeds": [1, 5], "losses": [{"exact fp8": 3.0, "fp8_cache=all": 3.01},
                                     {"exact fp8": 1.0, "fp8_cache=all": 1.01}]}
    seeds, per_seed = bench.merge_by_seed([b, a])
    assert seeds == [0, 1, 5]
    assert per_seed[1] == {"exact fp8": 3.0, "fp8_cache=all": 3.01, TORCH: 3.1}
    b["losses"][0]["exact fp8"] = 3.5
    with pytest.raises(ValueError, match="seed 1: two files give exact fp8 different losses"):
        bench.merge_by_seed([a, b])
    with pytest.raises(ValueError, match="different models or step counts"):
        bench.merge_by_seed([a, {"model": "deepseek", "steps": 200, "seeds": [7], "losses": [{}]}])
