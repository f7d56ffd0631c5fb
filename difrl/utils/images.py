"""Image pixels as an image file holds them.

    pixels = to_uint8(images)    # float [..., 3, H, W] in [0, 1] -> uint8, round(255 x) after clamping
    pixels = to_uint8(pixels)    # uint8 passes through unchanged (already on the grid)

The one rounding rule of the project (rewards that hand PIL an image, the reward server's wire format,
sample grids, the FD extractors): a PNG save rounds, while torchvision's `to_pil_image` truncates, which would bias every
pixel down by half a level.
"""

from __future__ import annotations

import torch


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """Float pixels in [0, 1] (any shape) -> uint8 round(255 x) after clamping to [0, 1]; same shape and device.
    uint8 input is returned as it is (it is 0..255 already: clamping it to [0, 1] would make every pixel 0 or 255)."""
    if images.dtype == torch.uint8:
        return images
    return (images.detach().float().clamp(0.0, 1.0) * 255.0).round().to(torch.uint8)
