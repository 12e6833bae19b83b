# Importing `deep_ep` from this folder (put on PYTHONPATH by `python -m weft.ep.as_deep_ep`)
# registers weft.ep as deep_ep; the import then returns weft.ep itself.
_weft_shim = True
from weft.ep.deep_ep_alias import register_as_deep_ep  # noqa: E402

register_as_deep_ep()
