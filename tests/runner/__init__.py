"""Tests of onnxdeploy.runner (mirrors runner/)."""
