"""Where optimum-onnx meets the plugins: entry-point discovery and the patches that route
``provider="<plugin>"`` to a plugin's session factory."""
