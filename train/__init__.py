"""Making MTP drafts: a draft for a target, trained by self-distillation on the target's own output
(`python -m train`). Imports the engine; the engine never imports this package."""
