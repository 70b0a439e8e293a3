"""The suite that runs inside the soft-RoCE test VM (deploy/testvm)."""
