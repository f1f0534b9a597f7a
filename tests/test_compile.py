"""torch.compile: the plain decoder (and every decoder option but entmax15) traces as one graph;
compiled forward, backward and cached decoding equal eager; 20 cached steps compile at most twice
(one recompilation, when the state's fill becomes symbolic); value checks stay on for eager calls.

Graph counting uses backends that run the traced graph as it is ("eager", "aot_eager", or the
counting one below); the inductor tests are marked slow."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from polyformer import AutoregressiveWrapper, TransformerWrapper
from tests.helpers import ids, tiny_lm
from tests.options import DECODER_OPTIONS, perturb


class CountingBackend:
    """A torch.compile backend that runs each traced graph unchanged and keeps it, so a test can
    count compilations (the first one and every recompilation)."""

    def __init__(self):
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs.append(gm)
        return gm.forward


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def plain_decoder() -> TransformerWrapper:
    """The issue's model: TransformerWrapper + Decoder(dim, depth, heads), nothing else."""
    return tiny_lm(seed=0).train()


def test_plain_decoder_forward_is_one_graph_without_breaks():
    model = plain_decoder().eval()
    explanation = torch._dynamo.explain(model)(ids(2, 12))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("name", [n for n in DECODER_OPTIONS if n != "attn_use_entmax15"])
def test_every_decoder_option_traces_as_one_graph(name):
    # entmax15 comes from the `entmax` package, whose autograd.Function dynamo cannot inline
    torch.manual_seed(0)
    model = tiny_lm(**dict(DECODER_OPTIONS[name]))
    explanation = torch._dynamo.explain(model)(ids(2, 10))
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons


def test_compiled_forward_and_backward_equal_eager():
    model = plain_decoder().train()
    x = ids(2, 12)

    def loss_of(net):
        logits = net(x[:, :-1])
        return F.cross_entropy(logits.transpose(1, 2), x[:, 1:])

    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss = loss_of(compiled)
    loss.backward()
    compiled_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    eager_loss = loss_of(model)
    eager_loss.backward()
    assert_close(loss, eager_loss, atol=1e-6, rtol=1e-6)
    for got, want in zip(compiled_grads, [p.grad for p in model.parameters()]):
        assert_close(got, want, atol=1e-6, rtol=1e-6)
    explanation = torch._dynamo.explain(loss_of)(model)     # the loss too: one graph
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0)


@pytest.mark.parametrize("name", ["default", "combined"])
def test_twenty_cached_steps_compile_at_most_twice_and_equal_eager(name):
    torch.manual_seed(0)
    model = perturb(tiny_lm(max_seq_len=64, **dict(DECODER_OPTIONS[name])), scale=0.05)
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    prompt = ids(2, 6)
    eager_state, compiled_state = model.new_state(2, 32), model.new_state(2, 32)
    with torch.no_grad():
        model(prompt, state=compiled_state)                 # the prompt runs eagerly
        token = model(prompt, state=eager_state)[:, -1].argmax(-1, keepdim=True)
        for _ in range(20):
            got, want = compiled(token, state=compiled_state), model(token, state=eager_state)
            assert_close(got, want, atol=1e-5, rtol=1e-5)
            token = want[:, -1].argmax(-1, keepdim=True)
    assert compiled_state.length == eager_state.length
    assert 1 <= len(backend.graphs) <= 2, f"{len(backend.graphs)} compilations for 20 steps"


def test_generate_with_compile_equals_eager_and_reuses_the_compiled_step():
    ar = AutoregressiveWrapper(perturb(plain_decoder(), scale=0.05))
    prompts = ids(2, 5)
    backend = CountingBackend()
    eager = ar.generate(prompts, 20, temperature=0.0)
    assert torch.equal(ar.generate(prompts, 20, temperature=0.0, compile=backend), eager)
    compilations = len(backend.graphs)
    assert 1 <= compilations <= 2
    assert torch.equal(ar.generate(prompts, 20, temperature=0.0, compile=backend), eager)
    assert len(backend.graphs) == compilations                 # a second call compiles nothing
    assert set(ar.state_dict()) == {f"net.{k}" for k in ar.net.state_dict()}   # nothing extra saved
    with pytest.raises(ValueError, match="cache_kv"):
        ar.generate(prompts, 4, compile=backend, cache_kv=False)
    with pytest.raises(ValueError, match="compile"):
        ar.generate(prompts, 4, compile=3)


def test_value_checks_stay_on_for_eager_calls_and_shape_checks_under_compile():
    model = plain_decoder().eval()
    compiled = torch.compile(model, backend="eager")
    assert_close(compiled(ids(2, 8)), model(ids(2, 8)))
    with pytest.raises(ValueError, match="token id 64"):
        model(torch.full((2, 8), 64))
    with pytest.raises(ValueError, match="max_seq_len=32"):
        model(ids(1, 33))
    with pytest.raises(ValueError, match=r"shape \(batch, seq\)"):
        compiled(ids(2, 8)[0])
    with pytest.raises(ValueError, match="max_seq_len=32"):
        compiled(ids(1, 33))


@pytest.mark.slow
def test_inductor_forward_equals_eager():
    model = plain_decoder().eval()
    compiled = torch.compile(model, fullgraph=True)
    for n in (12, 7):
        x = ids(2, n, seed=n)
        assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_inductor_generation_equals_eager():
    ar = AutoregressiveWrapper(perturb(plain_decoder(), scale=0.05))
    prompts = ids(2, 5)
    assert torch.equal(ar.generate(prompts, 12, temperature=0.0, compile=True),
                       ar.generate(prompts, 12, temperature=0.0))
