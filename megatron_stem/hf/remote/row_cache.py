"""The row cache for `modeling_stem.py`'s `from .row_cache import RowCache` inside the
package. An export bundles the module itself, `megatron_stem/model/row_cache.py`, under
this name (`hf/export.py`): exported code imports only torch and transformers."""

from megatron_stem.model.row_cache import RowCache

__all__ = ["RowCache"]
