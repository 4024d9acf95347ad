"""Writes the Hugging Face reference models that tests/unit/test_io_hugging_face.cpp loads.

Two tiny models, made with Hugging Face `transformers` itself so that the test checks loom
against the real thing (the names, the layouts, the transposed Conv1D weights of GPT-2, BERT's
token-type embedding and erf GELU):

    gpt2/  GPT2LMHeadModel    2 layers, 32 channels, 4 heads, 64 positions, vocabulary 101
    bert/  BertForMaskedLM    2 layers, 32 channels, 4 heads, 64 positions, vocabulary 103

Each directory holds what `save_pretrained` writes (config.json, model.safetensors) and
reference.json: a batch, the loss transformers computes on it, and the loss again after one
plain SGD step (lr 0.1) on that loss, which checks the gradients too. BERT's token-type
embeddings take no step: loom adds their row 0 into the position embeddings, so that sum is
what loom trains, where transformers trains the two tensors apart (the same function at load
time, a different parametrisation from then on). Every parameter is
perturbed after transformers' initialisation, so that no layernorm is all ones and no bias all
zeros: a tensor loaded into the wrong place changes the loss.

Run (2026-11-27: transformers 4.36.2 in a venv over Debian 12's python3-torch 1.13):
    /usr/bin/python3 -m venv --system-site-packages /tmp/hfvenv
    /tmp/hfvenv/bin/pip install transformers==4.36.2
    /tmp/hfvenv/bin/python tests/data/hugging_face/make_reference.py
"""

import json
import pathlib

import torch
import torch.nn.functional as F
import transformers

HERE = pathlib.Path(__file__).resolve().parent
BATCH, SEQ, LR = 2, 16, 0.1


def perturb(model, generator):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=generator))


def masked_lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-1)


def write(model, directory, batch, loss_of, frozen=()):
    model.eval()  # no dropout (the configs have none either)
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "generation_config.json").unlink(missing_ok=True)  # text generation settings: not needed
    loss = loss_of(model)
    loss.backward()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in frozen:
                p.sub_(LR * p.grad)
    loss_after = loss_of(model)
    reference = dict(batch, loss=loss.item(), sgd_lr=LR, loss_after_sgd=loss_after.item(),
                     transformers=transformers.__version__, torch=torch.__version__)
    (directory / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    print(directory.name, reference["loss"], reference["loss_after_sgd"])


def gpt2(generator):
    config = transformers.GPT2Config(vocab_size=101, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    perturb(model, generator)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=generator)
    targets = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=generator)
    targets[0, 3] = targets[1, 10] = -1  # ignored positions
    batch = dict(batch=BATCH, seq=SEQ, tokens=tokens.flatten().tolist(), targets=targets.flatten().tolist(),
                 lengths=[])
    write(model, HERE / "gpt2", batch, lambda m: masked_lm_loss(m(input_ids=tokens).logits, targets))


def bert(generator):
    config = transformers.BertConfig(vocab_size=103, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=64, hidden_act="gelu",
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.BertForMaskedLM(config)
    perturb(model, generator)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=generator)
    lengths = [SEQ, 11]  # the second row is padded: 11 real tokens, then padding no query attends to
    predict = torch.rand((BATCH, SEQ), generator=generator) < 0.3
    targets = torch.where(predict, torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=generator), -1)
    mask = torch.zeros((BATCH, SEQ), dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
        targets[row, length:] = -1
    batch = dict(batch=BATCH, seq=SEQ, tokens=tokens.flatten().tolist(), targets=targets.flatten().tolist(),
                 lengths=lengths)
    write(model, HERE / "bert", batch,
          lambda m: masked_lm_loss(m(input_ids=tokens, attention_mask=mask).logits, targets),
          frozen={"bert.embeddings.token_type_embeddings.weight"})


if __name__ == "__main__":
    generator = torch.Generator().manual_seed(20261127)
    torch.manual_seed(20261127)
    gpt2(generator)
    bert(generator)
