"""Patch: refuse, per request, what the tree sampler does not implement.

Why: DominoTree replaces vLLM's rejection sampler with sample-and-match over a tree;
it draws each node's token from the target's law as vLLM shapes it (temperature, top-k,
top-p, min_p, a seed; allowed tokens, min_tokens, logit_bias and the presence /
frequency / repetition penalties for the node's own path: engine/sampling_constraints.py)
and reports the raw logprobs of the tokens it emits, on the tree runner of model_runner
"v1" (the V2 runner's trees take temperature, top-k, top-p and seeds only, yet). Bad
words, structured outputs, thinking budgets and watermarking are not implemented, nor
the logprobs of given tokens, and silently ignoring them would change what the user
asked for. vLLM refuses min_p and logit_bias with any speculative method (its rejection
sampler lacks them); the tree sampler draws each row's target from the reshaped law and
accepts a draft only if it equals it, which stays lossless under any such reshaping, so
for the V1 tree runner that refusal is lifted.
How: `InputProcessor._validate_params` is wrapped; for a DominoTree engine it raises
`VLLMValidationError` naming the parameter: `LLM.generate` raises to the caller, the
engine and the other requests are untouched. The engine validates a request only once
its stream has begun, so a streamed request would get HTTP 200 and an error event; in a
process that built a DominoTree engine the OpenAI requests' `to_sampling_params`
(completions, chat, responses) are wrapped too, so that the API server answers 400
before any stream starts (what only the V2 runner lacks is refused by the engine: the
parsed request does not name the engine's runner). `SamplingParams._validate_spec_decode`
(vLLM's min_p / logit_bias refusal) is wrapped to pass while a V1 DominoTree engine
validates a request (a context variable set around the original `_validate_params`).
Removal: when the tree sampler implements these features.
"""

from __future__ import annotations

import contextvars
import functools

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.input_processor import InputProcessor

from ..speculative import ADDITIONAL_CONFIG_KEY

# What the V1 tree runner honours and the V2 runner's trees do not yet.
V1_ONLY = (
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "logit_bias",
    "allowed_token_ids",
)
# Set while a V1 DominoTree engine validates a request: vLLM's refusal of min_p and
# logit_bias under speculative decoding does not apply to its tree sampler.
_TREE_SAMPLER = contextvars.ContextVar("dominotree_tree_sampler", default=False)


def unsupported_features(
    params: SamplingParams, model_runner: str | None = None
) -> list[tuple[str, object]]:
    """(parameter, value) pairs of a request that DominoTree cannot honour on the given
    model runner (None: what no runner honours)."""
    checks = [
        ("logprobs", params.logprobs, params.logprobs is not None),
        ("presence_penalty", params.presence_penalty, params.presence_penalty != 0),
        ("frequency_penalty", params.frequency_penalty, params.frequency_penalty != 0),
        ("repetition_penalty", params.repetition_penalty, params.repetition_penalty != 1),
        ("min_p", params.min_p, params.min_p > 0),
        ("min_tokens", params.min_tokens, params.min_tokens > 0),
        ("logit_bias", params.logit_bias, bool(params.logit_bias)),
        ("allowed_token_ids", params.allowed_token_ids, bool(params.allowed_token_ids)),
        ("bad_words", params.bad_words, bool(params.bad_words)),
        ("structured_outputs", params.structured_outputs, params.structured_outputs is not None),
        ("logprob_token_ids", params.logprob_token_ids, params.logprob_token_ids is not None),
        (
            "thinking_token_budget",
            params.thinking_token_budget,
            params.thinking_token_budget is not None,
        ),
        ("watermarking", params.watermarking, bool(params.watermarking)),
    ]
    return [
        (name, value)
        for name, value, asked in checks
        if asked and (name not in V1_ONLY or model_runner == "v2")
    ]


def refuse_unsupported(params: SamplingParams, model_runner: str | None = None) -> None:
    bad = unsupported_features(params, model_runner)
    if bad:
        name, value = bad[0]
        if model_runner == "v2" and name in V1_ONLY:
            why = "on model_runner 'v2' (the default 'v1' honours it)"
        else:
            why = (
                "(its tree sampler honours temperature, top_k, top_p, min_p, seed, min_tokens, "
                "logit_bias, allowed_token_ids, presence, frequency and repetition penalties, "
                "and logprobs)"
            )
        raise VLLMValidationError(
            f"{name}={value!r} is not supported with speculative method 'dominotree' {why}; "
            f"remove {name} from the request",
            parameter=name,
            value=value,
        )


def patch_input_processor() -> None:
    original = InputProcessor._validate_params
    if getattr(original, "_dominotree", False):
        return

    @functools.wraps(original)
    def _validate_params(self, params, *args, **kwargs):
        options = (self.vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if options is None or not isinstance(params, SamplingParams):
            return original(self, params, *args, **kwargs)
        model_runner = options.get("model_runner", "v1")
        refuse_unsupported(params, model_runner)
        token = _TREE_SAMPLER.set(model_runner == "v1")
        try:
            return original(self, params, *args, **kwargs)
        finally:
            _TREE_SAMPLER.reset(token)

    _validate_params._dominotree = True
    InputProcessor._validate_params = _validate_params

    check = SamplingParams._validate_spec_decode

    @functools.wraps(check)
    def _validate_spec_decode(self, speculative_config):
        if not _TREE_SAMPLER.get():
            check(self, speculative_config)

    SamplingParams._validate_spec_decode = _validate_spec_decode


def patch_openai_requests() -> None:
    """Called when this process builds a DominoTree engine's config (an API server
    serves one engine): its OpenAI requests are checked as they are parsed."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    for request_class in (CompletionRequest, ChatCompletionRequest, ResponsesRequest):
        original = request_class.to_sampling_params
        if getattr(original, "_dominotree", False):
            continue

        def to_sampling_params(self, *args, _original=original, **kwargs):
            params = _original(self, *args, **kwargs)
            if isinstance(params, SamplingParams):
                refuse_unsupported(params)
            return params

        functools.update_wrapper(to_sampling_params, original)
        to_sampling_params._dominotree = True
        request_class.to_sampling_params = to_sampling_params
