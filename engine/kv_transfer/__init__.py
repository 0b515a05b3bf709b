"""Disaggregated prefill/decode: `--kv-transfer-config`, and the NIXL connector that moves KV blocks
between engines (see connector.py for the protocol)."""
from engine.kv_transfer.config import KVTransferConfig
from engine.kv_transfer.connector import KVConnectorOutput, NixlConnector

__all__ = ["KVTransferConfig", "KVConnectorOutput", "NixlConnector"]
