"""The inference device: ONNX templates the fleet's weights are written into, the
follower that keeps a served model current (``python -m edge_client follow``) and
inference (``python -m edge_client infer``). Never imports torch (the ``infer`` profile)."""
