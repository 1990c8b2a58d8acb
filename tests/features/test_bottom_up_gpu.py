"""The bottom-up flavours on CUDA against the ports' CPU goldens (``test_bottom_up_reference.py``'s data).

Marked ``gpu``: skipped with a reason where no CUDA device is present (CI); ``make test-gpu`` runs them. With
TF32 off every stage agrees with the reference to fp32 rounding across devices (the same 1e-4 bound as on the
CPU); the kept boxes are the reference's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from captioning.config import ExtractorConfig
from captioning.features.extractor import make_extractor
from tests.features.bottom_up import weights
from tests.features.test_bottom_up_reference import PORTS, close

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module", params=PORTS)
def cuda_port(request, tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    port = request.param
    g = np.load(weights.DATA / f"golden-{port}.npz", allow_pickle=False)
    path = weights.write_checkpoint(port, tmp_path_factory.mktemp(port) / ("w.pkl" if port == "airsplay" else
                                                                           "w.pth"), seed=0)
    ex = make_extractor(ExtractorConfig(flavour=port, weights=str(path), device="cuda", min_size=192, max_size=320,
                                        proposals=24, channels_last=False))
    return port, g, ex


def test_cuda_stages_equal_the_reference(cuda_port):
    port, g, ex = cuda_port
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.inference_mode():
            for i in range(2):
                x = torch.from_numpy(g[f"img{i}_input"])[None].cuda()
                close(ex.stages.backbone(x)[0].cpu().numpy(), g[f"img{i}_res4"], f"{port} image {i} res4 (CUDA)")
                res4 = torch.from_numpy(g[f"img{i}_res4"])[None].cuda()
                size = tuple(int(v) for v in g[f"img{i}_input_size"])
                props = ex.stages.proposals(res4, size, float(g[f"img{i}_scale"][0]))
                close(props.boxes.cpu().numpy(), g[f"img{i}_proposals"], f"{port} image {i} proposals (CUDA)")
                pooled, cls, _ = ex.stages.head(res4, torch.from_numpy(g[f"img{i}_proposals"]).cuda())
                close(pooled.cpu().numpy(), g[f"img{i}_pooled"], f"{port} image {i} pooled (CUDA)")
                close(cls.cpu().numpy(), g[f"img{i}_cls_prob"], f"{port} image {i} class probabilities (CUDA)")
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
