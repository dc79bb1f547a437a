"""kvplug's Triton kernels for attention (``decode``: split-K paged decode; ``extend``: paged
prefill/extend) and for a step's metadata (``decode_step``: a decode batch's derived fields;
``page_lists``: FlashInfer's CSR page lists). Each module imports Triton, so import them only
where it is installed."""
