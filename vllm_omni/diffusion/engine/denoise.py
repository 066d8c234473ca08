"""What both engines and the denoising roles run a batch through: failure isolation (`run_isolated`: one
request's failure, or running out of memory, does not fail its neighbours) and the one denoising step
(`denoise_step`) that step mode and the split ``denoise`` stage take."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from vllm_omni.diffusion.engine.request import DiffusionRequest
from vllm_omni.diffusion.features.previews import Previews, clean_latents
from vllm_omni.logger import init_logger

if TYPE_CHECKING:
    from vllm_omni.diffusion.families.steppers import Stepper

logger = init_logger(__name__)

T = TypeVar("T")


def run_isolated(
    run: Callable[[list[T]], Sequence[Any]],
    items: list[T],
    *,
    what: str,
    name: Callable[[T], str],
    on_oom_split: Callable[[], None],
) -> list[Any]:
    """``run(items)``, with failures isolated: one result or exception per item.

    Out of memory: split the items in halves and retry each (``on_oom_split`` frees
    cached memory first). Any other error: run the items one by one, so only an
    item that fails on its own fails.
    """
    try:
        return list(run(items))
    except torch.OutOfMemoryError as exc:
        if len(items) == 1:
            logger.warning("%s %s ran out of memory alone: %s", what, name(items[0]), exc)
            return [exc]
        half = len(items) // 2
        logger.warning("out of memory with a batch of %d; retrying as %d + %d", len(items), half, len(items) - half)
        on_oom_split()
        first = run_isolated(run, items[:half], what=what, name=name, on_oom_split=on_oom_split)
        return first + run_isolated(run, items[half:], what=what, name=name, on_oom_split=on_oom_split)
    except Exception as exc:  # noqa: BLE001 - any pipeline error is isolated to its request below
        if len(items) == 1:
            logger.warning("%s %s failed: %s: %s", what, name(items[0]), type(exc).__name__, exc)
            return [exc]
        logger.warning(
            "batch of %d failed (%s: %s); re-running its requests one at a time", len(items), type(exc).__name__, exc
        )
        return [run_isolated(run, [item], what=what, name=name, on_oom_split=on_oom_split)[0] for item in items]


def denoise_step(
    requests: list[DiffusionRequest],
    stepper: Stepper,
    on_oom_split: Callable[[], None],
    previews: Previews | None,
    around_step: Callable[[list[DiffusionRequest]], AbstractContextManager[None]],
) -> list[tuple[DiffusionRequest, BaseException]]:
    """One denoising step for every request: one denoiser forward over all their rows (a failure there is isolated
    to its request), then each request moves one step along its own schedule, then the previews due after this step
    (from the predictions). ``around_step``: the stage's extensions around the step (`Extensions.around_step`: the
    timings'). Returns the requests that failed, with why; a failed scheduler update fails every request it held,
    whose state it may have changed."""
    with torch.inference_mode():
        with around_step(requests):
            predictions = run_isolated(
                lambda batch: stepper.predict([r.state for r in batch]),
                requests,
                what="request",
                name=lambda r: r.request_id,
                on_oom_split=on_oom_split,
            )
            failed = [(r, p) for r, p in zip(requests, predictions, strict=True) if isinstance(p, BaseException)]
            stepped = [(r, p) for r, p in zip(requests, predictions, strict=True) if not isinstance(p, BaseException)]
            if not stepped:
                return failed
            # the clean latents of the previews due, taken before the update moves the latents on
            due: list[tuple[DiffusionRequest, torch.Tensor]] = []
            for request, prediction in stepped:
                state = request.state
                if previews is not None and previews.due(request, state.step + 1):
                    index = state.offset + state.step
                    due.append(
                        (
                            request,
                            clean_latents(state.noise_scheduler, index, state.timestep, prediction, state.latents),
                        )
                    )
            try:
                stepper.advance([r.state for r, _ in stepped], [p for _, p in stepped])
            except Exception as exc:  # noqa: BLE001 - a scheduler update that fails leaves its requests unusable
                logger.warning("scheduler step of %d requests failed: %s: %s", len(stepped), type(exc).__name__, exc)
                return failed + [(r, exc) for r, _ in stepped]
        if previews is not None:  # else none is due
            for request, clean in due:
                previews.emit(request, clean)
    for request, _ in stepped:
        request.state.forwards += 1
        request.state.batch_total += len(requests)
        request.steps_done = request.state.step
        if request.state.done and request.state.sde is not None:
            request.trajectory = request.state.sde.trajectory()
    return failed
