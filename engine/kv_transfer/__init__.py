"""Disaggregated prefill/decode: the NIXL connector that moves KV blocks between engines (see
connector.py for the protocol); its settings are `engine.config.KVTransferConfig`."""
