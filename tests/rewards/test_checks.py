"""Input checks of the rule rewards: the documented tolerances hold in every float precision."""

import pytest
import torch

from mmgrpo.rewards import as_rgb_images, as_rgb_videos


@pytest.mark.parametrize("dtype, step", [(torch.bfloat16, 2**-7), (torch.float16, 2**-10), (torch.float32, 5e-4)])
def test_one_rounding_step_past_the_range_is_clamped(dtype, step):
    """bf16 has no value between 1 and 1 + 2**-7: a bf16 decode that overshoots 1 at all lands there."""
    x = torch.tensor([[[[1.0 + step, -step]]]], dtype=torch.float32).to(dtype).expand(2, 3, 1, 2)
    assert x.max().item() > 1 and x.min().item() < 0
    out = as_rgb_images(x)
    assert out.dtype == torch.float32 and out.max().item() == 1.0 and out.min().item() == 0.0
    assert as_rgb_videos(x.unsqueeze(1)).max().item() == 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_more_than_that_is_still_an_error(dtype):
    with pytest.raises(ValueError, match=r"images must be in \[0, 1\]; got min 0 max 1.0[3-4]"):
        as_rgb_images(torch.full((1, 3, 2, 2), 1.03, dtype=dtype).clamp(min=0).index_fill(3, torch.tensor([0]), 0))
