"""VAE patch parallel (``vae_patch_parallel_size``): the tiles of diffusers' tiled VAE decode are decoded on the
ranks of the group in turn (tile k on rank k mod world), sent to every rank, and blended as diffusers blends them,
so the image equals the same tiling on one rank.

diffusers has no hook between a tiled decode's tiles and its blending, so `enable_vae_patch_parallel` gives the VAE
its own ``tiled_decode``: `AutoencoderKL.tiled_decode` with the tiles shared out. Only ``AutoencoderKL`` (Flux, SD3,
SD, SDXL) for now; Wan's and Qwen-Image's VAEs tile their own way.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

# From its module: to mypy, diffusers' top-level names are the dummy classes of its torch-less install.
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.models.autoencoders.vae import DecoderOutput


def enable_vae_patch_parallel(vae, rank: int, world: int) -> None:
    """Turn on ``vae``'s tiling, with its tiles decoded across the ``world`` ranks of the initialized group."""
    if type(vae).tiled_decode is not AutoencoderKL.tiled_decode:
        raise ValueError(
            f"vae_patch_parallel_size {world}: {type(vae).__name__} is not split into patches yet (AutoencoderKL only)"
        )
    vae.enable_tiling()
    vae.tiled_decode = functools.partial(_tiled_decode, vae, rank, world)


def _tiled_decode(vae: AutoencoderKL, rank: int, world: int, z: torch.Tensor, return_dict: bool = True):
    """`AutoencoderKL.tiled_decode`, each tile decoded by one rank and broadcast from it."""
    overlap_size = int(vae.tile_latent_min_size * (1 - vae.tile_overlap_factor))
    blend_extent = int(vae.tile_sample_min_size * vae.tile_overlap_factor)
    row_limit = vae.tile_sample_min_size - blend_extent
    upscale = vae.tile_sample_min_size // vae.tile_latent_min_size
    dtype = next(vae.decoder.parameters()).dtype
    post_quant_conv = vae.post_quant_conv if vae.config["use_post_quant_conv"] else None
    rows: list[list[tuple[torch.Tensor, int]]] = []
    count = 0
    for i in range(0, z.shape[2], overlap_size):
        row = []
        for j in range(0, z.shape[3], overlap_size):
            owner, count = count % world, count + 1
            tile = z[:, :, i : i + vae.tile_latent_min_size, j : j + vae.tile_latent_min_size]
            if owner == rank:
                if post_quant_conv is not None:
                    tile = post_quant_conv(tile)
                decoded = vae.decoder(tile).contiguous()
            else:
                height, width = tile.shape[2] * upscale, tile.shape[3] * upscale
                channels = vae.config["out_channels"]
                decoded = torch.empty(z.shape[0], channels, height, width, dtype=dtype, device=z.device)
            row.append((decoded, owner))
        rows.append(row)
    for row in rows:  # in the order every rank lists them, so the collectives pair up
        for decoded, owner in row:
            dist.broadcast(decoded, src=owner)
    tiles = [[decoded for decoded, _ in row] for row in rows]
    result_rows = []
    for i, tile_row in enumerate(tiles):  # diffusers' blending, unchanged
        result_row = []
        for j, tile in enumerate(tile_row):
            if i > 0:
                tile = vae.blend_v(tiles[i - 1][j], tile, blend_extent)
            if j > 0:
                tile = vae.blend_h(tile_row[j - 1], tile, blend_extent)
            result_row.append(tile[:, :, :row_limit, :row_limit])
        result_rows.append(torch.cat(result_row, dim=3))
    dec = torch.cat(result_rows, dim=2)
    return (dec,) if not return_dict else DecoderOutput(sample=dec)
