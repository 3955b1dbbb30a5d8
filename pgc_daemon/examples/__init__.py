"""Model factories (MODEL_SPECs) that ship with pgc: the demo's MiniLM and small test models."""
