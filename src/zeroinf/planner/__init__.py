"""Plan before the run: the per-unit plan, the estimate of memory and step time, the machine profile.

    plan = zeroinf.plan("125m", world_size=2, tokens_per_step=8192)   # every candidate placement
    print(plan.table()); cfg = plan.best.config

Modules: unit_plan.py (what `shard` builds, per unit; pure), model_facts.py (a model's units, FLOPs
and activations, read on the meta device), profile.py (the machine: probes, cache, bf16 detection),
estimate.py (bytes per tier and step time of one placement; pure), choose.py (candidates, `auto`),
report.py (table and JSON), timeline.py (one measured step as an HTML timeline).
Nothing here is imported by `import zeroinf` beyond `zeroinf.plan`, which loads the rest lazily.
"""
