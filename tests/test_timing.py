"""snapkv_lab.core.timing's table helper: each row over the full cache's of the same length and batch."""

import math

import pandas as pd

from snapkv_lab.core.timing import over_full_cache


def test_each_row_is_divided_by_the_full_cache_of_its_own_length_and_batch():
    table = pd.DataFrame(dict(tokens=[1000, 1000, 1000, 2000, 2000], batch=[1, 1, 4, 1, 1],
                              policy=["FullCache", "SnapKV", "SnapKV", "FullCache", "SnapKV"],
                              prefill_s=[2.0, 3.0, 5.0, 4.0, 2.0], decode_ms=[10.0, 5.0, 8.0, 20.0, 30.0]))
    out = over_full_cache(table)
    assert out.prefill_s_vs_full.tolist()[:2] == [1.0, 1.5] and out.prefill_s_vs_full.tolist()[3:] == [1.0, 0.5]
    assert out.decode_ms_vs_full.tolist()[4] == 1.5
    # batch 4 has no full-cache row: no ratio rather than one over another batch's
    assert math.isnan(out.prefill_s_vs_full[2]) and math.isnan(out.decode_ms_vs_full[2])
    assert "kv_mib_vs_full" not in out and "prefill_s_vs_full" not in table  # absent columns skipped, input untouched
