"""The component names of the pipelines served here, in one place: what a stage loads or skips (`roles`), what a
download fetches (`vllm_omni.model_sources.files`) and which LoRA rows a component reads (`lora.adapters`) all name
them from here."""

TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
"""The text-encoder components of the pipelines we serve."""

CONDITIONERS = ("projection_model", "duration_embedder", "condition_encoder")
"""What the audio pipelines condition their denoiser with besides their text encoders: Stable Audio's projection of
the text and of the clip's start and end seconds, Stable Audio 3's duration embedder, ACE-Step's condition encoder."""

DENOISERS = ("transformer", "transformer_2", "unet")
"""The denoiser components of the pipelines we serve."""


def loaded_denoisers(pipeline) -> list[str]:
    """The names of the denoisers the pipeline holds (a stage that skips them holds none)."""
    return [name for name in DENOISERS if getattr(pipeline, name, None) is not None]


OUTPUT_PROCESSORS = (("image_processor", "postprocess"), ("video_processor", "postprocess_video"))
"""Where a pipeline turns decoded pixels into its output type, in every mode and stage: (attribute, method)."""
