"""Recall@K of image-text retrieval, the standard protocol of MSCOCO and Flickr30K.

Image → text: an image succeeds at K when ANY of its captions is among the K captions most similar to it.
Text → image: a caption succeeds at K when its image is among the K images most similar to it.
Ties count against the query: a wrong candidate scoring exactly as high as the best right one ranks
before it, so a model that scores everything alike (a collapsed one) gets recall near 0, not a
flattering share of lucky tie-breaks.
"""

from __future__ import annotations

import torch

KS = (1, 5, 10)


def image_to_text_ranks(similarity: torch.Tensor, caption_image: torch.Tensor, first_image: int = 0) -> torch.Tensor:
    """similarity [n, M] of images first_image … first_image + n − 1 against all M captions, caption_image
    int64 [M] -> int64 [n]: the 0-based rank of each image's best caption (wrong captions scoring >= it)."""
    images = torch.arange(first_image, first_image + len(similarity), device=similarity.device)
    own = caption_image[None, :] == images[:, None]  # [n, M]
    best = similarity.masked_fill(~own, float("-inf")).amax(1, keepdim=True)
    return ((similarity >= best) & ~own).sum(1)


def text_to_image_ranks(similarity: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
    """similarity [m, N] of m captions against all N images, image int64 [m] (each caption's own) ->
    int64 [m]: the 0-based rank of each caption's image (other images scoring >= it)."""
    own = similarity.gather(1, image[:, None])
    return (similarity >= own).sum(1) - 1  # the image itself is counted once


def retrieval_recalls(image_emb: torch.Tensor, caption_emb: torch.Tensor, caption_image: torch.Tensor,
                      ks: tuple[int, ...] = KS, chunk: int = 1024) -> dict[str, float]:
    """{"i2t_r1", …, "t2i_r10"}: fractions in [0, 1] of the N images and M captions that succeed at each K.

    image_emb [N, E], caption_emb [M, E] (similarity is their dot product), caption_image int64 [M] in
    [0, N). The [N, M] similarity is formed `chunk` rows at a time (MSCOCO's 5K test: 5,000 × 25,000).
    """
    caption_image = caption_image.to(image_emb.device)
    i2t = torch.cat([image_to_text_ranks(image_emb[s:s + chunk] @ caption_emb.T, caption_image, s)
                     for s in range(0, len(image_emb), chunk)])
    t2i = torch.cat([text_to_image_ranks(caption_emb[s:s + chunk] @ image_emb.T, caption_image[s:s + chunk])
                     for s in range(0, len(caption_emb), chunk)])
    recalls = {f"i2t_r{k}": (i2t < k).double().mean().item() for k in ks}
    return recalls | {f"t2i_r{k}": (t2i < k).double().mean().item() for k in ks}
