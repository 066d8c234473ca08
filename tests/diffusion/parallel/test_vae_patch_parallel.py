"""`enable_vae_patch_parallel` in one process: a rank decodes only its share of the tiles, and with the others'
tiles received (the broadcast played by the test) the image equals diffusers' tiled decode on one rank."""

import pytest
import torch
from diffusers import AutoencoderKL, AutoencoderKLWan

from vllm_omni.diffusion.parallel import vae_patch
from vllm_omni.diffusion.parallel.vae_patch import enable_vae_patch_parallel

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_decodes_its_tiles_and_blends_all_of_them_as_one_rank_would(tiny_flux, monkeypatch, rank):
    vae = AutoencoderKL.from_pretrained(tiny_flux, subfolder="vae", dtype=torch.float32)
    latents = torch.randn(2, vae.config.latent_channels, 3 * vae.tile_latent_min_size // 2, vae.tile_latent_min_size)
    tiles = []
    vae.decoder.register_forward_hook(lambda module, args, output: tiles.append(output.clone()))
    vae.enable_tiling()
    with torch.no_grad():
        expected = vae.decode(latents).sample
        assert len(tiles) > 2  # the tiled decode ran
        reference, tiles[:] = list(tiles), []
        sent = []

        def broadcast(tensor, src):  # the other rank's tile is the one the reference decoded
            if src != rank:
                tensor.copy_(reference[len(sent)])
            sent.append(src)

        monkeypatch.setattr(vae_patch.dist, "broadcast", broadcast)
        enable_vae_patch_parallel(vae, rank, 2)
        image = vae.decode(latents).sample
    assert sent == [k % 2 for k in range(len(reference))]
    assert len(tiles) == len([k for k in range(len(reference)) if k % 2 == rank])  # its own share only
    torch.testing.assert_close(image, expected, rtol=0, atol=0)


def test_a_vae_that_tiles_its_own_way_is_refused_by_name(tiny_wan):
    vae = AutoencoderKLWan.from_pretrained(tiny_wan, subfolder="vae", dtype=torch.float32)
    with pytest.raises(ValueError, match="vae_patch_parallel_size 2: AutoencoderKLWan is not split into patches yet"):
        enable_vae_patch_parallel(vae, 0, 2)
