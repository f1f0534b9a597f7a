"""The auxiliary-loss channel (polyformer/losses.py): a block reports a named loss into the forward's
context; the wrappers return it, AutoregressiveWrapper, XTransformer and the training objectives add
it with its weight, and gradients reach the reporting block."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from polyformer import AutoregressiveWrapper, Decoder, Encoder, TransformerWrapper, XTransformer
from polyformer.losses import AuxLosses, loss_names
from polyformer.train.objectives import LanguageModeling, MaskedLanguageModeling


class Reporting(nn.Module):
    """Runs an attention block and reports the mean square of its input as "energy", with a
    learned factor, so the loss has a gradient path of its own."""

    loss_names = ("energy",)

    def __init__(self, inner: nn.Module, weight: float):
        super().__init__()
        self.inner, self.weight = inner, weight
        self.factor = nn.Parameter(torch.tensor(2.0))

    def forward(self, x, ctx, prev_scores=None):
        ctx.losses.report("energy", self.factor * x.pow(2).mean(), self.weight)
        return self.inner(x, ctx, prev_scores)


def reporting(model: TransformerWrapper, weight: float = 0.5) -> TransformerWrapper:
    for block in model.attn_layers.blocks:
        if block.kind == "a":
            block.branch = Reporting(block.branch, weight)
    return model


def decoder(causal: bool = True) -> TransformerWrapper:
    torch.manual_seed(0)
    stack = Decoder if causal else Encoder
    return TransformerWrapper(num_tokens=20, max_seq_len=16, attn_layers=stack(dim=16, depth=2, heads=2))


def energy(model: TransformerWrapper, x: torch.Tensor) -> torch.Tensor:
    """The expected term, by hand: the sum over attention blocks of factor * mean(input ** 2), the
    input being the normalised stream a block reads (`record.mems`)."""
    _, record = model(x, return_intermediates=True)
    blocks = [b for b in model.attn_layers.blocks if b.kind == "a"]
    return sum(b.branch.factor * h.pow(2).mean() for b, h in zip(blocks, record.mems))


def test_record_sums_reports_per_name_and_keeps_the_weight():
    model = reporting(decoder())
    x = torch.randint(0, 20, (2, 8))
    _, record = model(x, return_intermediates=True)
    assert set(record.losses.terms) == {"energy"} and record.losses.weights == {"energy": 0.5}
    torch.testing.assert_close(record.losses.terms["energy"], energy(model, x))
    torch.testing.assert_close(record.losses.total(), 0.5 * energy(model, x))
    assert loss_names(model) == ("energy",) and loss_names(decoder()) == ()


def test_autoregressive_loss_adds_the_weighted_term_and_its_gradient_reaches_the_block():
    model = reporting(decoder(), weight=0.25)
    ar = AutoregressiveWrapper(model)
    x = torch.randint(0, 20, (2, 9))
    loss, aux = ar(x, return_losses=True)
    ce = F.cross_entropy(model(x[:, :-1]).transpose(1, 2), x[:, 1:])
    torch.testing.assert_close(loss, ce + 0.25 * energy(model, x[:, :-1]))
    loss.backward()
    factor = model.attn_layers.blocks[0].branch.factor
    assert factor.grad is not None and factor.grad.abs() > 0
    torch.testing.assert_close(ar(x), loss.detach())
    assert aux.values().keys() == {"energy"}


def test_a_model_without_reporters_is_called_plainly():
    model = decoder()
    x = torch.randint(0, 20, (2, 9))
    ce = F.cross_entropy(model(x[:, :-1]).transpose(1, 2), x[:, 1:])
    loss, aux = AutoregressiveWrapper(model)(x, return_losses=True)
    torch.testing.assert_close(loss, ce)
    assert not aux and aux.total() is None


def test_xtransformer_adds_the_encoder_and_decoder_terms():
    torch.manual_seed(0)
    model = XTransformer(dim=16, enc_num_tokens=20, enc_depth=1, enc_heads=2, enc_max_seq_len=8,
                         dec_num_tokens=20, dec_depth=1, dec_heads=2, dec_max_seq_len=8)
    reporting(model.encoder, weight=1.0)
    reporting(model.decoder.net, weight=1.0)
    src, tgt = torch.randint(0, 20, (2, 8)), torch.randint(0, 20, (2, 8))
    loss, aux = model(src, tgt, return_losses=True)
    encoded, enc_record = model.encoder(src, return_embeddings=True, return_intermediates=True)
    plain, dec_aux = model.decoder(tgt, context=encoded, return_losses=True)
    torch.testing.assert_close(aux.terms["energy"], enc_record.losses.terms["energy"] + dec_aux.terms["energy"])
    torch.testing.assert_close(loss, plain + enc_record.losses.total())


@pytest.mark.parametrize("objective", ["lm", "mlm"])
def test_training_objectives_add_the_terms_and_keep_them_for_the_logs(objective):
    model = reporting(decoder(causal=objective == "lm"), weight=0.5)
    batch = torch.randint(0, 19, (2, 9))
    if objective == "lm":
        obj = LanguageModeling()
        ce = F.cross_entropy(model(batch[:, :-1]).transpose(1, 2), batch[:, 1:])
    else:
        obj = MaskedLanguageModeling(mask_id=19, num_tokens=19, generator=torch.Generator().manual_seed(1))
        inp, target = MaskedLanguageModeling(mask_id=19, num_tokens=19,
                                             generator=torch.Generator().manual_seed(1)).mask(batch[:, :-1])
        ce = F.cross_entropy(model(inp).transpose(1, 2), target, ignore_index=-100)
    loss = obj.loss(model, batch)
    term = obj.aux.terms["energy"]
    torch.testing.assert_close(loss, ce + 0.5 * term)


def test_validation_scores_leave_the_auxiliary_terms_out():
    """Perplexity and bits per byte measure the prediction: a reporting block (same logits) scores
    as the model without it, though its training loss adds the term."""
    from types import SimpleNamespace

    from polyformer.train.scoring import evaluate
    from polyformer.train.settings import RunSettings

    settings = RunSettings()
    settings.model.max_seq_len, settings.train.batch_size, settings.train.eval_batches = 8, 2, 2
    data = SimpleNamespace(val=torch.randint(0, 20, (64,), generator=torch.Generator().manual_seed(0)),
                           bytes_per_token=1.0)
    model = decoder()
    plain = evaluate(model, LanguageModeling(), settings, data)
    reporting(model, weight=0.5)
    objective = LanguageModeling()
    assert evaluate(model, objective, settings, data) == pytest.approx(plain, rel=1e-6)
    assert objective.aux.total() > 0


def test_reports_are_refused_when_not_scalars_or_weights_disagree():
    aux = AuxLosses()
    with pytest.raises(ValueError, match="'x' must be a scalar"):
        aux.report("x", torch.ones(2), 1.0)
    aux.report("x", torch.tensor(1.0), 1.0)
    with pytest.raises(ValueError, match="'x' reported with weights 1.0 and 2.0"):
        aux.report("x", torch.tensor(1.0), 2.0)


def test_gradient_checkpointing_reports_once_and_keeps_the_gradient():
    # the backward runs each checkpointed block again; its reports must not add to the record a second time
    x = torch.randint(0, 20, (2, 8))
    plain = reporting(decoder())
    torch.manual_seed(0)
    checkpointed = reporting(TransformerWrapper(num_tokens=20, max_seq_len=16, attn_layers=Decoder(
        dim=16, depth=2, heads=2, gradient_checkpointing=True)))
    checkpointed.load_state_dict(plain.state_dict())
    results = []
    for model in (plain, checkpointed):
        model.train()
        _, record = model(x, return_intermediates=True)
        (record.losses.total() + 0 * sum(p.sum() for p in model.parameters())).backward()
        factor = model.attn_layers.blocks[0].branch.factor
        results.append((record.losses.values()["energy"], factor.grad.clone()))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1])
