"""Checkpoints: the train state's Orbax manager with pipeline-layout moves (`manager`), and the
model's weights read and written leaf by leaf (`params`: ParamsReader, lazy saving,
model_config.json). Training, conversion and inference all go through here."""
