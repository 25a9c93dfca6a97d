"""Avro schemas of fleetline's events, one file per version: `<Name>.v<N>.avsc`.

Old versions stay here forever, so any message ever written can still be decoded.
"""

from pathlib import Path

SCHEMA_DIR = Path(__file__).resolve().parent
