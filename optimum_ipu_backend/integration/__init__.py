"""Where optimum-onnx meets the plugins: entry-point discovery, ``provider="auto"``, and the patches that
route ``provider="<plugin>"`` to a plugin's session factory."""

# The provider name that asks for the best provider usable here (integration/auto.py). Defined here, the
# one module both the patches and auto load, so that the patches need not import auto at start-up.
AUTO = "auto"
