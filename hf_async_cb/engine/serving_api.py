"""The Engine's serving API: a background loop that takes requests while it runs (start(),
add_request(), abort(), shutdown()); the loop itself is engine/online.py. A part of Engine (its base
class), kept apart from the engine's building and its batch runs."""

from __future__ import annotations

import functools
import itertools
import weakref

from hf_async_cb.engine.online import BackgroundLoop
from hf_async_cb.engine.request_handle import RequestHandle
from hf_async_cb.engine.profiling import StepProfile
from hf_async_cb.engine.prompt_embeds import PromptEmbeds
from hf_async_cb.engine.requests import SamplingParams, one_params
from hf_async_cb.engine.seeding import _random_seed, seed_requests
from hf_async_cb.model.kv_fingerprint import kv_fingerprint
from hf_async_cb.model.media_inputs import checked_media
from hf_async_cb.model.model_guard import model_guard
from hf_async_cb.model.vision import media_embeds


class ServingAPI:
    """Engine's methods for serving (see the module docstring). They read the engine's model, config,
    runner, pool and caches, and its `_background`, `_lifecycle`, `_online_seed` and `_submissions`."""

    def start(self, mode: str | None = None) -> None:
        """Run the loop on a background thread; then add_request() / abort() / shutdown()."""
        with self._lifecycle:  # (two threads' start(): one loop, the other told it is running)
            self._start(mode)

    def _start(self, mode: str | None) -> None:
        self._check_open()
        if self._background is not None and self._background.ended:  # it stopped on an error: a new one
            self.shutdown(timeout=0)
        if self._background is not None:
            if self._background.stopping:
                raise RuntimeError("the engine's background loop is still stopping (a shutdown() that timed out): "
                                   "call shutdown() again to wait for it, then start().")
            raise RuntimeError("the engine's background loop is already running.")
        if self.tensor_parallel is not None:
            raise ValueError("a background loop cannot serve a tensor-parallel model: each rank would admit requests "
                             "at its own steps and the ranks' collectives would no longer match; use generate().")
        # The model claimed for this loop first, so that of two engines started at once on one model one
        # is refused here, with the reason; the loop's thread gives the claim up once it holds the model.
        guard, claim = model_guard(self.model), object()
        if not guard.reserve_serving(claim):
            raise RuntimeError("the model is serving another Engine's background loop; shutdown() that one first.")
        try:
            if not guard.held_elsewhere():  # else another call has it swapped: the loop checks
                self.runner.check_model_unchanged()
            self.check_caches()
            self.prepared_model.embeddings_refusal()  # checked now: the serving loop holds the model from here on
            background = BackgroundLoop(self, self._mode(mode), claim)
            if self.config.profile:  # the loop's steps, from here to shutdown()
                background.pipeline.profile = self.last_profile = StepProfile(self.streams)
                background.cache_before = self.prefix_cache_stats()
            # Each session numbers its requests from 0 under BatchingConfig.seed, else under a seed
            # drawn from torch's generator when its first sampled request without a seed arrives.
            self._online_seed, self._submissions = self.config.seed, itertools.count()
            background.start()
        except BaseException:
            guard.release_reservation(claim)
            raise
        self._background = background

    def add_request(self, prompt, params: SamplingParams | None = None, *, logits_processor=None,
                    stopping_criteria=None, on_token=None, embeds: PromptEmbeds | None = None,
                    media: dict | None = None, **param_kwargs) -> RequestHandle:
        """Submit a prompt (token ids, or text when the engine has a tokenizer); returns its handle.
        `params` or the keyword arguments as in generate(): it stops at the model's EOS ids unless
        they name others (eos_token_ids=() runs past EOS); `embeds` as in make_request().

        `media`: a vision-language model's image inputs for this one prompt, as its processor gives
        them for a batch of that prompt alone (`pixel_values`, `image_grid_thw`, `image_sizes`, ...;
        the prompt its `input_ids`, placeholders included). The loop thread merges them as generate()
        does (model/vision.py), right before the request is taken in; an error there fails the handle.

        `on_token(request, token)`: called on the loop thread for every token, right after the
        handle has it (the moment any reader can see it), e.g. to time tokens without a reader
        thread per request; keep it short, it runs between the loop's steps. If it raises, the
        request fails as for a raising stopping criterion."""
        self._check_open()
        background = self._background  # (read once: a shutdown() from another thread may drop it meanwhile)
        if background is None:
            raise RuntimeError("start() the engine before add_request().")
        if on_token is not None and not callable(on_token):
            raise ValueError(f"on_token must be a callable (request, token), got {on_token!r}.")
        if isinstance(prompt, str):
            if media is not None:  # (a tokenizer leaves the image placeholders unexpanded: the merge fails later)
                raise ValueError("add_request(media=...) takes the processor's input_ids as the prompt (its image "
                                 "placeholders expanded to the image's tokens), not text.")
            if self.tokenizer is None:
                raise ValueError("a text prompt needs Engine(..., tokenizer=...); or pass token ids.")
            prompt = self.tokenizer(prompt)["input_ids"]
        params = one_params(params, param_kwargs)
        if media is not None and embeds is not None:
            raise ValueError("add_request takes embeds or media, not both.")
        if media is not None:
            media, ready = checked_media(self.model, media)
        request = self.make_request(prompt, params, logits_processor=logits_processor,
                                    stopping_criteria=stopping_criteria, on_token=on_token, embeds=embeds)
        seed_requests([request], self._online_seed, first_index=next(self._submissions), draw=self._online_draw)
        handle = RequestHandle(request)
        if media is not None:
            handle._before_admission = functools.partial(
                media_embeds, media=media, refusal=self.prepared_model.embeddings_refusal(), cache=self.cache,
                towers=self.tower_outputs, ready=ready)
        handle._engine = weakref.ref(self)  # (abort() checks it; the handle does not keep the engine alive)
        background.submit(handle)  # (refused if that loop is stopping by now)
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Stop a request; it ends with FinishReason.ABORTED and the tokens it had."""
        owner = getattr(handle, "_engine", None)
        if owner is None or owner() is not self:
            raise ValueError(f"request {getattr(handle, 'request_id', handle)!r} was not added to this engine.")
        background = self._background
        if background is not None:
            background.abort(handle)

    def _online_draw(self) -> int:
        """The session's engine seed, drawn from torch's generator once (the first sampled request
        without a seed of its own asks for it), whichever thread asks first."""
        with self._lifecycle:
            if self._online_seed is None:
                self._online_seed = _random_seed()
            return self._online_seed

    def shutdown(self, cancel: bool = False, timeout: float | None = 60.0) -> None:
        """Stop the background loop: cancel=True aborts what is queued or running, else it finishes
        first. Waits at most `timeout` seconds; raises TimeoutError if the loop is still busy then.
        Called on the loop's thread (from on_token or a done-callback), it only asks: the loop stops
        as it would otherwise, without the wait, and a shutdown() from another thread joins it."""
        background = self._background
        if background is None:
            return
        if not background.stop(cancel, timeout):
            if background.on_loop_thread:  # asked, not joined: a thread cannot wait for itself
                return
            raise TimeoutError(f"the engine's loop did not stop within {timeout} s")
        if self.config.profile and background.cache_before is not None:  # (as Engine.run's)
            background.pipeline.profile.prefix_cache = self._cache_share(background.cache_before)
        with self._lifecycle:
            if self._background is background:
                self._background = None
        if self.prefix_cache is not None:
            # The loop cached K/V checked against the weights' counters alone (and emptied on the
            # user's clear_prefix_cache() after writes through `.data`): they are those of the weights
            # as the loop left them, not as start() read them. The next call or start() compares with these.
            model = self.runner._model()  # (None once the model is collected: nothing to compare then)
            self._kv_fingerprint = kv_fingerprint(model, content=True) if model is not None else None
