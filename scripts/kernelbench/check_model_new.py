# SPDX-License-Identifier: BSD-3-Clause
"""Shared check of a KernelBench ModelNew against its Model: output and the gradients of x and of
every parameter, on fresh random inputs (Model's GroupNorm affine parameters randomized first)."""
import torch


def check(Model, ModelNew, get_inputs, get_init_inputs, device, n_inputs=5, tol=None):
    """Max relative error of ModelNew vs Model (KernelBench's four names); raises AssertionError
    above `tol` when given."""
    torch.manual_seed(0)
    model = Model(*get_init_inputs()).to(device)
    with torch.no_grad():
        model.group_norm.weight.normal_(1.0, 0.5)
        model.group_norm.bias.normal_()
    new = ModelNew(*get_init_inputs()).to(device)
    new.load_state_dict(model.state_dict())
    worst = 0.0
    for _ in range(n_inputs):
        x = get_inputs()[0].to(device)
        outs = []
        for m in (model, new):
            xg = x.clone().requires_grad_()
            y = m(xg)
            y.backward(torch.ones_like(y) * 0.1 + y * 0.01)
            outs.append([y.detach(), xg.grad] + [p.grad for p in m.parameters()])
            m.zero_grad()
        for a, b in zip(*outs):
            worst = max(worst, ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item())
    if tol is not None:
        assert worst <= tol, f"ModelNew vs Model: max relative error {worst:.2e} > {tol:.0e}"
    return worst
