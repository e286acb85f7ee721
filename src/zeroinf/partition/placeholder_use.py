"""A backward that met a stage-3 parameter's empty placeholder: say what happened and the fix.

[Note: a parameter used outside its unit's forward]
Between its unit's uses a stage-3 parameter holds an empty placeholder (partition/unit.py), so code
that computes with `model.parameters()` outside the forward (an L2 or proximal penalty added to the
loss, a norm of the weights) takes the placeholders, or a gathered unit's values that autograd
saved and that are a placeholder again by the time backward reads them. Autograd then fails with a
message about shapes: "Function PowBackward0 returned an invalid gradient at index 0 - got [0] but
expected shape compatible with [64]". `AdamW.backward` turns that message, at stage 3, into one
that names the cause and the fix: compute such terms inside `with zeroinf.gathered(params):`, with
the backward inside the block too, which trains as plain PyTorch does
(tests/partition/test_gathered.py), or use AdamW's `weight_decay` for an L2 penalty. A read that
does not reach backward (logging a norm) cannot be caught this cheaply: it computes on empty
tensors, which the README says.
"""

from __future__ import annotations

import re

# autograd's validate_outputs: "... returned an invalid gradient at index 0 - got [0, 0] but expected ..."
_INVALID_GRADIENT = re.compile(r"returned an invalid gradient at index \d+ - got \[([\d, ]*)\]")


def explain_placeholder_gradient(err: RuntimeError) -> RuntimeError | None:
    """The error to raise instead of `err` when it is autograd's shape check failing on an empty
    placeholder's gradient; None when it is anything else."""
    match = _INVALID_GRADIENT.search(str(err))
    if match is None or "0" not in [d.strip() for d in match.group(1).split(",")]:
        return None
    return RuntimeError(
        "backward reached a stage-3 parameter as its empty placeholder: some code used parameters "
        "outside their unit's forward (a penalty or norm over model.parameters(), a weight read by "
        "another module), where a stage-3 parameter holds no values. Compute such terms inside "
        "`with zeroinf.gathered(params):` and call opt.backward inside that block too, or use "
        f"zeroinf.AdamW's weight_decay for an L2 penalty. Autograd said: {err}"
    )
