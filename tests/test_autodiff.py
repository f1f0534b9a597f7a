"""What polyformer.autodiff reports under each nesting of torch.func transforms and forward-mode AD
(it reads private torch interfaces, so these pin them), and that each reading routes attention right."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import forward_ad
from torch.func import grad, jacfwd, jacrev, jvp, vmap

from polyformer.autodiff import GRAD, JVP, VMAP, forward_mode, levels, needs_reference, transformed


def reading(x: torch.Tensor) -> dict:
    return {"vmap": levels(VMAP), "grad": levels(GRAD), "jvp": levels(JVP), "transformed": transformed(x),
            "forward": forward_mode(x), "reference": needs_reference(x)}


def observed(transform) -> dict:
    """What the helpers read inside `transform` applied to a function of one tensor."""
    seen = {}

    def f(x):
        seen.update(reading(x))
        return (x * x).sum()
    transform(f)(torch.ones(3))
    return seen


PLAIN = dict(vmap=0, grad=0, jvp=0, transformed=False, forward=False, reference=False)


def on(**changes) -> dict:
    return {**PLAIN, "transformed": True, **changes}


@pytest.mark.parametrize("transform, expected", [
    (lambda f: f, PLAIN),
    (lambda f: vmap(lambda x: f(x)[None]), on(vmap=1)),
    (lambda f: grad(f), on(grad=1)),
    (lambda f: jacrev(f), on(grad=1)),
    (lambda f: grad(lambda x: grad(f)(x).sum()), on(grad=2, reference=True)),
    (lambda f: jacrev(jacrev(f)), on(grad=2, reference=True)),
    (lambda f: lambda x: jvp(f, (x,), (torch.ones_like(x),))[1], on(jvp=1, forward=True, reference=True)),
    (lambda f: jacfwd(f), on(vmap=1, jvp=1, forward=True, reference=True)),
    (lambda f: vmap(lambda x: jvp(f, (x,), (x,))[1][None]), on(vmap=1, jvp=1, forward=True, reference=True)),
    (lambda f: lambda x: jvp(grad(f), (x,), (x,))[1], on(grad=1, jvp=1, forward=True, reference=True)),
], ids=["none", "vmap", "grad", "jacrev", "grad-of-grad", "jacrev-of-jacrev", "jvp", "jacfwd", "vmap-of-jvp",
        "jvp-of-grad"])
def test_what_each_nesting_reads(transform, expected):
    assert observed(transform) == expected


def test_forward_ad_tangents_are_read_per_tensor_outside_torch_func():
    plain, tangent = torch.ones(3), torch.full((3,), 2.0)
    assert not forward_mode(plain)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(plain, tangent)
        assert forward_mode(dual) and forward_mode(plain, None, dual) and needs_reference(None, dual)
        assert not forward_mode(plain) and not transformed(plain, None)
        assert transformed(dual)


def test_a_forward_ad_level_counts_under_vmap_where_tangents_cannot_be_read():
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(torch.ones(2, 3), torch.ones(2, 3))
        seen = []
        vmap(lambda x: seen.append(forward_mode(x)) or x)(dual)
    assert seen == [True]
