"""Checks that transformers loads a model loom saved (gpt2_train/bert_train --save-hf) and that it
computes the reference batch's loss that loom computed: make_reference.py's batch, on the saved
weights. Not part of ctest (it needs transformers); run by hand, e.g.

    gpt2_train --init-hf tests/data/hugging_face/gpt2 --steps 1 --lr 0 --warmup 0 --batch 4 --seq 32 \\
               --save-hf /tmp/saved_gpt2
    /tmp/hfvenv/bin/python tests/data/hugging_face/check_saved.py gpt2 /tmp/saved_gpt2

With lr 0 the saved weights are the reference's, so the loss printed must be reference.json's.
"""

import json
import pathlib
import sys

import torch
import torch.nn.functional as F
import transformers

family, saved = sys.argv[1], pathlib.Path(sys.argv[2])
reference = json.loads((pathlib.Path(__file__).resolve().parent / family / "reference.json").read_text())
shape = (reference["batch"], reference["seq"])
tokens = torch.tensor(reference["tokens"]).reshape(shape)
targets = torch.tensor(reference["targets"]).reshape(shape)
mask = torch.ones(shape, dtype=torch.long)
for row, length in enumerate(reference["lengths"]):
    mask[row, length:] = 0
model_class = transformers.GPT2LMHeadModel if family == "gpt2" else transformers.BertForMaskedLM
model = model_class.from_pretrained(saved).eval()  # refuses missing or mis-shaped tensors
with torch.no_grad():
    logits = model(input_ids=tokens, attention_mask=mask).logits
loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-1).item()
print(f"{family}: transformers on {saved}: loss {loss:.7f}; reference {reference['loss']:.7f}; "
      f"relative difference {abs(loss - reference['loss']) / reference['loss']:.2e}")
sys.exit(0 if abs(loss - reference["loss"]) <= 1e-5 * reference["loss"] else 1)
