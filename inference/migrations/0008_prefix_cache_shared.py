from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("inference", "0007_draft_model"),
    ]

    operations = [
        migrations.AddField(
            model_name="modelentry",
            name="prefix_cache_shared",
            field=models.BooleanField(
                default=False,
                help_text="Share cached prompt prefixes across teams. Off: each team hits only "
                "its own (another team can neither reuse nor time them).",
            ),
        ),
    ]
