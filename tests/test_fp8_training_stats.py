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
    assert st.gap[TORCH] == pytest.approx(0.005 / 3)
    # signed per-seed gaps +1% and -1%: drift 1%, stdev sqrt(2)%, two SE 2 * sqrt(2)% / sqrt(2)
    assert st.drift["fp8_cache=act_input"] == pytest.approx(0.01)
    assert st.two_se["fp8_cache=act_input"] == pytest.approx(0.02)
    assert st.gap["exact fp8"] == 0 and st.two_se["exact fp8"] == 0
    checks = dict(bench.cache_checks(st.gap))
    assert [ok for text, ok in checks.items() if "within 0.25%" in text] == [False]  # 0.333%
    assert [ok for text, ok in checks.items() if "below torch's" in text] == [False]  # 0.333% vs 0.167%


def test_merged_files_keep_the_runs_every_seed_has():
    per_seed = [{"exact fp8": 2.0, "fp8_cache=all": 2.0, "bf16": 2.1},
                {"exact fp8": 2.0, "fp8_cache=all": 2.01}]
    st = bench.cache_stats(per_seed)
    assert list(st.mean) == ["exact fp8", "fp8_cache=all"]
    assert st.gap["fp8_cache=all"] == pytest.approx(0.0025)
    single = bench.cache_stats(per_seed[:1])
    assert single.two_se["fp8_cache=all"] is None
