"""graphpass.estimate against the peak torch's MemTracker measures over the same real step on the CPU,
for the one-process cases of tests/test_estimate.py (its models and its measured_peak).

    PYTHONPATH=.:tests python benchmarks/estimate_vs_real.py
"""
import sys
import os
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import torch, graphpass
import test_estimate as T
cases = [("block adamw eager", T.Block, (T._ids(),), T.ADAMW, None, 1, {}),
         ("block sgd compiled mb2", T.Block, (T._ids(),), T.SGD, T.EAGER, 2, {}),
         ("block sgd-momentum mb3", T.Block, (T._ids(),), T.SGD_MOMENTUM, None, 3, {}),
         ("block adamw-foreach compiled", T.Block, (T._ids(),), T.ADAMW_FOREACH, T.EAGER, 1, {}),
         ("block bf16 fp8 adamw", lambda: T.Block().to(torch.bfloat16), (T._ids(),), T.ADAMW, T.FP8, 1, {}),
         ("hf llama adamw-foreach compiled", T._llama, (), T.ADAMW_FOREACH, T.EAGER, 1, "ids"),
         ("hf mixtral bf16 sgd-momentum compiled", T._mixtral, (), T.SGD_MOMENTUM, T.EAGER, 1, "ids")]
for name, build, inputs, opt, options, mb, kw in cases:
    if kw == "ids":
        ids = T._ids(); kw = dict(input_ids=ids, labels=ids); lf = None
    else:
        lf = T._cross_entropy
    torch._dynamo.reset()
    cfg = graphpass.Config.from_options(**options) if options else None
    m = build()
    est = graphpass.estimate(m, *inputs, optimizer=opt, loss_fn=lf, config=cfg, micro_batches=mb, **kw)
    real = T.measured_peak(m, inputs, optimizer=opt, loss_fn=lf, options=options, micro_batches=mb, **kw)
    print(f"{name}: estimate {est.peak_bytes:,} B, measured {real:,} B, {100*(est.peak_bytes-real)/real:+.2f}%", flush=True)
