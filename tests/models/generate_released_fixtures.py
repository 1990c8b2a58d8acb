"""Write the released-code fixtures of ``tests/models/test_released_fixtures.py`` (a script, not a test: pytest
does not collect it, and nothing imports it).

Each family's reference model is built by its released constructor from a checkout of the released repository,
every parameter is randomised with a fixed seed, the weights are saved the way that code's training saves them,
with a vocabulary in its released format, and the released code computes the golden outputs (teacher-forced
log-probs, greedy captions as words). Sizes are tiny so the files stay small.

    python tests/models/generate_released_fixtures.py zodiac CHECKOUT   # zanyarz/zodiac
    python tests/models/generate_released_fixtures.py lw CHECKOUT       # luogen1996/LWTransformer
    python tests/models/generate_released_fixtures.py acort CHECKOUT    # jiahuei/sparse-image-captioning

Options: ``--out DIR`` (default ``tests/models/fixtures/released``; each family writes ``DIR/<family>/``). Run it
with the project's interpreter; ``acort`` also needs the ``sentencepiece`` package importable (the released
tokenizer; e.g. ``pip install --target /tmp/deps sentencepiece`` and ``PYTHONPATH=/tmp/deps``). The released code
is imported from the checkout as it is, except for the import-time shims named in each function (modules the
model code does not use).
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import sys
import tempfile
import types
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch

D_IN = 12  # region feature width of every fixture
REGIONS = (5, 3, 4)  # regions of the three fixture images


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter drawn from a seeded normal: matrices N(0, 1/fan_in), LayerNorm gains 1 + N(0, 0.1^2),
    other vectors N(0, 0.1^2). Buffers (sinusoid tables, decoding states) keep their released values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if p.dim() >= 2:
                p.copy_(r / math.sqrt(p.shape[-1]))
            elif name.endswith(("a_2", "norm.weight", "layer_norm.weight", "lnorm.weight", "lnorm1.weight",
                                "lnorm2.weight")):
                p.copy_(1 + 0.1 * r)
            else:
                p.copy_(0.1 * r)


def _inputs(seed: int, boxes: bool = False) -> dict[str, list]:
    """Three images' region features (rounded to float16, the precision a capflow feature store keeps) and
    boxes (x1 < x2, y1 < y2 in [0, 1])."""
    g = torch.Generator().manual_seed(seed)
    feats = [torch.randn(n, D_IN, generator=g).half().float() for n in REGIONS]
    out: dict[str, list] = {"features": [f.tolist() for f in feats]}
    if boxes:
        bx = []
        for n in REGIONS:
            a, b = torch.rand(n, 2, generator=g) * 0.5, torch.rand(n, 2, generator=g) * 0.5 + 0.5
            bx.append(torch.cat([a, b], 1).tolist())
        out["boxes"] = bx
    return out


def _shim(name: str) -> None:
    """An empty module for an import the model code does not use."""
    sys.modules.setdefault(name, types.ModuleType(name))


# ---------------------------------------------------------------------- ZoDIAC (ruotianluo's code base)
def zodiac(checkout: Path, out: Path) -> None:
    """``ZTransformerModel`` (zodiac-sigmoid) built by its constructor, randomised, saved as
    ``misc/utils.save_checkpoint`` saves it (``torch.save(model.state_dict(), 'model.pth')``) with a
    ``cocotalk.json`` ``ix_to_word``; the same weights loaded into ``ZTransformerModel2`` (zodiac-tanh: the same
    keys). Golden: each image alone (batch of one, the decision capflow implements), teacher-forced log-probs
    (``model(fc, att, seq)``) and greedy captions (``model(..., mode='sample')``, ``utils.decode_sequence``)."""
    sys.path.insert(0, str(checkout))
    import misc.utils as utils
    from models.ZTransformerModel import ZTransformerModel
    from models.ZTransformerModel2 import ZTransformerModel2

    words = ["a", "man", "dog", "on", "the", "with", "sitting", "grass", "of", "UNK", "table", "red", "cat", "and"]
    ix_to_word = {str(i + 1): w for i, w in enumerate(words)}
    seq_length = 10
    opt = SimpleNamespace(vocab_size=len(words), input_encoding_size=8, rnn_size=16, num_layers=2, drop_prob_lm=0.5,
                          max_length=seq_length, seq_length=seq_length, fc_feat_size=D_IN, att_feat_size=D_IN,
                          att_hid_size=8, use_bn=0, vocab=ix_to_word, N_enc=2, N_dec=2, d_model=8, d_ff=16,
                          num_att_heads=2, dropout=0.1)
    torch.manual_seed(0)
    sigmoid = ZTransformerModel(opt)
    _randomise(sigmoid, 28)  # a seed whose captions vary (EOS, UNK, gates differ)
    sigmoid.eval()
    tanh = ZTransformerModel2(opt)
    tanh.load_state_dict(sigmoid.state_dict())
    tanh.eval()

    inputs = _inputs(1)
    feats = [torch.tensor(f) for f in inputs["features"]]
    g = torch.Generator().manual_seed(2)
    captions = [torch.randint(1, len(words) + 1, (n,), generator=g).tolist() for n in (6, 4, 5)]
    golden: dict = {"inputs": inputs, "seq_length": seq_length, "teacher_captions": captions}
    for gate, model in (("sigmoid", sigmoid), ("tanh", tanh)):
        logps, greedy = [], []
        with torch.no_grad():
            for f, cap in zip(feats, captions, strict=True):
                fc, att = f.mean(0, keepdim=True), f[None]
                seq = torch.tensor([[0, *cap, 0]])  # the released labels: 0 = BOS / EOS
                logps.append(model(fc, att, seq, None)[0].tolist())  # (len + 1, V + 1)
                s, _ = model(fc, att, None, opt={"sample_method": "greedy", "beam_size": 1}, mode="sample")
                greedy.append(utils.decode_sequence(ix_to_word, s)[0])
            # the released batch decoding pools over the batch: the same images decoded together differ
            pad = torch.zeros(len(feats), max(REGIONS), D_IN)
            masks = torch.zeros(len(feats), max(REGIONS))
            for i, f in enumerate(feats):
                pad[i, : len(f)], masks[i, : len(f)] = f, 1
            s, _ = model(pad.mean(1), pad, masks, opt={"sample_method": "greedy", "beam_size": 1}, mode="sample")
            batched = utils.decode_sequence(ix_to_word, s)
        golden[gate] = {"teacher_logprobs": logps, "greedy": greedy}
        print(f"zodiac-{gate}: one image at a time {greedy}; the released batch of 3 {batched}")
    out.mkdir(parents=True, exist_ok=True)
    torch.save(sigmoid.state_dict(), out / "model.pth")
    (out / "cocotalk.json").write_text(json.dumps({"ix_to_word": ix_to_word}, indent=1))
    (out / "golden.json").write_text(json.dumps(golden))


# ---------------------------------------------------------------------- LW-Transformer (M2 code base)
def lw(checkout: Path, out: Path) -> None:
    """The released ``vocab.pkl`` (unpickled here with the released ``data.vocab.Vocab``) written as JSON
    (``vocab_full.json``, its ``itos``: what a user gives ``--vocab``), and a small vocabulary built by the same
    ``Vocab`` class (``TextField.build_vocab``'s specials) from the released counts of the 40 most frequent words
    and every white-space token. ``Transformer(bos, LTransformerEncoder, LTransformerDecoderLayer)`` as
    ``train.py --model lwtransformer --LFFN`` builds it (tiny sizes passed to the same constructors), randomised,
    saved as ``train.py`` saves it and then its ``state_dict`` entry alone (the README's instruction: the training
    checkpoint holds numpy RNG state, which ``weights_only`` refuses). Golden: teacher-forced log-probs
    (``model(images, seq)``) and greedy captions (``model.test``, the M2 greedy, 20 steps; ``TextField.decode``)."""
    root = checkout / "ImageCaptioning"
    sys.path.insert(0, str(root))
    _shim("h5py")  # data/field.py imports it for ImageDetectionsField (features from an HDF5 file): unused here
    models_pkg = types.ModuleType("models")  # models/__init__.py imports a models/transformer.py absent from the
    models_pkg.__path__ = [str(root / "models")]  # release: the package is entered without it
    sys.modules["models"] = models_pkg
    from data.field import TextField
    from data.vocab import Vocab
    from models.transformer_lightweight import (
        LScaledDotProductAttention,
        LTransformerDecoderLayer,
        LTransformerEncoder,
        Transformer,
    )

    with open(root / "vocab.pkl", "rb") as f:
        full = pickle.load(f)  # the released file, in a scratch run of the released code only
    blank = [w for w in full.itos if not w.strip()]
    assert len(full.itos) == 10201 and len(blank) == 6, (len(full.itos), blank)
    specials = full.itos[:4]
    chosen = [w for w in full.itos[4:44]] + blank
    vocab = Vocab(Counter({w: full.freqs[w] for w in chosen}), specials=specials)
    text_field = TextField(init_token="<bos>", eos_token="<eos>", lower=True, remove_punctuation=True,
                           nopoints=False)
    text_field.vocab = vocab

    d, d_k, d_v, h, d_ff, n = 16, 4, 4, 4, 32, 2  # --d_k 4 at d=16, h=4: the 1x expansion (d_k = d_v)
    kw = {"LFFN": True, "d_k": d_k, "d_v": d_v, "h": h, "d_ff": d_ff}
    encoder = LTransformerEncoder(n, 0, attention_module=LScaledDotProductAttention, d_model=d, d_in=D_IN,
                                  attention_module_kwargs={"m": 40}, **kw)
    decoder = LTransformerDecoderLayer(len(vocab), 54, n, vocab.stoi["<pad>"], d_model=d, **kw)
    model = Transformer(vocab.stoi["<bos>"], encoder, decoder)
    # a seed whose released greedy captions never pick <pad>/<bos> (capflow's search never emits them) and do
    # pick a white-space token (so the fixture shows its mapping)
    eos, max_len = vocab.stoi["<eos>"], 20
    images = torch.tensor(_inputs(3)["features"][0])[None].expand(3, -1, -1).clone()
    inputs = {"features": [(images[i] + 0.5 * i).half().float().tolist() for i in range(3)]}
    images = torch.tensor(inputs["features"])  # three images with 5 regions each (no padding: see the test)
    for seed in range(100, 400):
        _randomise(model, seed)
        model.eval()
        with torch.no_grad():
            outs, _ = model.test(images, max_len, eos)
        caps = text_field.decode(outs, join_words=False)
        if not any(w in ("<pad>", "<bos>") for c in caps for w in c) and any(w in blank for c in caps for w in c):
            break
    else:
        raise SystemExit("no seed gave greedy captions without <pad>/<bos> and with a white-space token")
    g = torch.Generator().manual_seed(4)
    seq = torch.cat([torch.full((3, 1), vocab.stoi["<bos>"]), torch.randint(4, len(vocab), (3, 7), generator=g)], 1)
    with torch.no_grad():
        logp = model(images, seq)
    golden = {"inputs": inputs, "seed": seed, "max_len": max_len, "teacher_inputs": seq.tolist(),
              "teacher_logprobs": logp.tolist(), "greedy": caps}
    print(f"lw: seed {seed}, greedy {caps}")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:  # train.py's checkpoint, then its state dict alone
        ckpt = Path(tmp) / "lwtransformer_best.pth"
        import numpy as np

        torch.save({"torch_rng_state": torch.get_rng_state(), "numpy_rng_state": np.random.get_state(),
                    "epoch": 0, "val_loss": 0.0, "state_dict": model.state_dict()}, ckpt)
        torch.save(torch.load(ckpt, weights_only=False)["state_dict"], out / "lw_state_dict.pth")
    (out / "vocab.json").write_text(json.dumps(vocab.itos, ensure_ascii=False))
    (out / "vocab_full.json").write_text(json.dumps(full.itos, ensure_ascii=False))
    (out / "golden.json").write_text(json.dumps(golden, ensure_ascii=False))


# ---------------------------------------------------------------------- ACORT (jiahuei/sparse-image-captioning)
CAPTIONS = """a man riding a horse on a beach
a dog sitting on the grass next to a red ball
two people standing in a kitchen with a table
a cat sleeping on a bed near a window
a woman holding an umbrella in the rain
a bus parked on the side of a street
a plate of food with a fork and a knife
a group of people playing frisbee in a park
a train traveling down the tracks near a station
a little girl eating a slice of pizza
a bird sitting on a branch of a tree
a man surfing a wave in the ocean
"""


def acort(checkout: Path, out: Path) -> None:
    """The released ``RadixTokenizer`` trained (SentencePiece word model) on a few captions, radix base 8;
    ``RelationTransformerModel`` with the ACORT settings (Share-kV, cross-layer sharing ``(0, 0, 1)`` in the
    encoder and the decoder, 3 layers) built by its constructor, randomised, saved as ``model_best.pth`` (the bare
    state dict) beside a ``config.json`` with the released run's keys, ``tokenizer/word.vocab`` as the vocabulary.
    The generator's <pad>/<bos> biases are then set to -20: the released greedy could pick them, capflow's search
    never does, and a trained model never ranks them first. Golden: teacher-forced log-probs (``_forward``),
    greedy decoding with the released step cache (``_sample``: ``_generate_captions`` with incremental decoding)
    and with the released modules re-decoding the whole prefix every step (the same loop without the cache), as
    radix tokens and as ``RadixTokenizer.decode`` strings."""
    sys.path.insert(0, str(checkout))
    from sparse_caption.models.relation_transformer import RelationTransformerModel
    from sparse_caption.tokenizer import RadixTokenizer

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "captions.txt").write_text(CAPTIONS)
        config = SimpleNamespace(log_dir=tmp, start_from="", tokenizer_train_files=str(Path(tmp) / "captions.txt"),
                                 vocab_size=200, logging_level=None, radix_base=8)
        tok = RadixTokenizer(config)
        vocab_text = (Path(tmp) / "tokenizer" / "word.vocab").read_text()
    (out / "tokenizer").mkdir(exist_ok=True)
    (out / "tokenizer" / "word.vocab").write_text(vocab_text)
    seq_length = 11
    run = {"share_att_encoder": "kv", "share_att_decoder": "kv", "share_layer_encoder": [0, 0, 1],
           "share_layer_decoder": [0, 0, 1], "d_model": 8, "dim_feedforward": 16, "num_layers": 3, "num_heads": 2,
           "drop_prob_src": 0.5, "max_seq_length": seq_length, "att_feat_size": D_IN, "radix_base": 8,
           "tokenizer": "radix", "no_box_trigonometric_embedding": False}
    cfg = SimpleNamespace(**run, vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                          unk_token_id=tok.unk_token_id, pad_token_id=tok.pad_token_id)
    cfg.share_layer_encoder, cfg.share_layer_decoder = (0, 0, 1), (0, 0, 1)
    torch.manual_seed(0)
    model = RelationTransformerModel(cfg)
    _randomise(model, 4)  # a seed whose captions vary (EOS, <unk>, the two decodings differ)
    with torch.no_grad():
        bias = model.model.generator.proj.bias
        bias[tok.pad_token_id] = bias[tok.bos_token_id] = -20.0
    model.eval()

    inputs = _inputs(6, boxes=True)
    n = REGIONS[0]  # three images of REGIONS[0] regions (no padding: the released clip_att / pack_wrapper)
    feats = torch.stack([torch.tensor(f[:n]) if len(f) >= n else torch.tensor(f + f)[:n]
                         for f in inputs["features"]])
    boxes = torch.stack([torch.tensor(b[:n]) if len(b) >= n else torch.tensor(b + b)[:n] for b in inputs["boxes"]])
    inputs = {"features": feats.tolist(), "boxes": boxes.tolist()}

    def prefix_greedy() -> torch.Tensor:  # _generate_captions' greedy loop, re-decoding the whole prefix
        att, bx, _, masks, _ = model._prepare_feature(feats, None, boxes)
        memory = model.model.encode(att, bx, masks)
        it = torch.full((len(feats),), model.bos_idx, dtype=torch.long)
        ys = it[:, None]
        seq = torch.full((len(feats), seq_length), model.pad_idx, dtype=torch.long)
        unfinished = it != model.eos_idx
        for t in range(seq_length + 1):
            dec = model.model.decode(memory, masks, ys, model.subsequent_mask(ys.size(1)))
            logprobs = model.model.generator(dec[:, -1])
            if t == seq_length:
                break
            _, it = torch.max(logprobs, 1)
            seq[:, t] = it * unfinished.type_as(it)
            unfinished = unfinished * (it != model.eos_idx)
            if unfinished.sum() == 0:
                break
            ys = torch.cat([ys, it[:, None]], 1)
        return seq

    g = torch.Generator().manual_seed(7)
    words = torch.randint(4, len(tok.processor), (3, 4), generator=g)
    teacher = torch.tensor([[tok.bos_token_id, *tok._encode_radix_id(r.tolist()), tok.eos_token_id] for r in words])
    with torch.no_grad():
        logp = model._forward(feats, boxes, teacher)  # inputs teacher[:, :-1]
        cached, _ = model._sample(feats, boxes, None, opt={"beam_size": 1})
        cached = cached[:, 0]
        prefix = prefix_greedy()
    golden = {"inputs": inputs, "seq_length": seq_length, "radix_base": 8, "digits": tok.tokens_per_word,
              "teacher_inputs": teacher[:, :-1].tolist(), "teacher_logprobs": logp.tolist(),
              "step_cached": {"tokens": cached.tolist(), "captions": [tok.decode(r) for r in cached]},
              "whole_prefix": {"tokens": prefix.tolist(), "captions": [tok.decode(r) for r in prefix]}}
    print("acort: step-cached", golden["step_cached"]["captions"], "whole prefix", golden["whole_prefix"]["captions"])
    torch.save(model.state_dict(), out / "model_best.pth")
    (out / "config.json").write_text(json.dumps(run, indent=1))
    (out / "golden.json").write_text(json.dumps(golden))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("family", choices=["zodiac", "lw", "acort"])
    p.add_argument("checkout", type=Path, help="a clone of the family's released repository")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "fixtures" / "released")
    args = p.parse_args()
    {"zodiac": zodiac, "lw": lw, "acort": acort}[args.family](args.checkout.resolve(), args.out / args.family)


if __name__ == "__main__":
    main()
