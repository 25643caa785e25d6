"""The function names dsfix looks for in a checkout and the ones it writes, in one place."""

SAVE_NAMES = ("save_hf_format", "save_zero_three_model")  # the checkout's own save functions
RENAMES = {  # each save function -> dsfix's replacement, which its calls are renamed to
    "save_hf_format": "save_hf_format_safetensors",
    "save_zero_three_model": "save_zero_three_model_safetensors",
}
NEW_NAMES = {new: old for old, new in RENAMES.items()}
PUBLIC_NAMES = tuple(RENAMES.values())
SAVE_HF, SAVE_Z3 = RENAMES["save_hf_format"], RENAMES["save_zero_three_model"]  # what smoke calls
CORE = {  # the template's functions that dsfix's public functions call
    "save_hf_format": "_dsfix_save_hf_format",
    "save_zero_three_model": "_dsfix_save_zero_three_model",
}


def is_dsfix_name(name: str) -> bool:
    """Top-level names that belong to dsfix's inserted block, in any template version (classes: ``_Dsfix``)."""
    return name in PUBLIC_NAMES or name.startswith(("_dsfix_", "_DSFIX_", "_Dsfix"))
