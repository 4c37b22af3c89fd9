import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('inference', '0012_model_source_and_residency'),
    ]

    operations = [
        migrations.CreateModel(
            name='ModelPrice',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('effective_from', models.DateTimeField(help_text='From when this price applies (UTC).')),
                ('input_per_million', models.DecimalField(decimal_places=6, help_text='Per million prompt tokens.', max_digits=14, verbose_name='input')),
                ('cached_input_per_million', models.DecimalField(blank=True, decimal_places=6, help_text='Per million prompt tokens served from the prefix cache. Empty: the input price.', max_digits=14, null=True, verbose_name='cached input')),
                ('output_per_million', models.DecimalField(decimal_places=6, help_text='Per million completion tokens.', max_digits=14, verbose_name='output')),
                ('per_image', models.DecimalField(decimal_places=9, default=0, help_text='Per input image, for models that take images (none do yet).', max_digits=14, verbose_name='per image')),
                ('created_at', models.DateTimeField(auto_now_add=True)),
                ('model', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='prices', to='inference.modelentry')),
            ],
            options={
                'verbose_name': 'model price',
                'ordering': ['model', '-effective_from'],
                'constraints': [models.UniqueConstraint(fields=('model', 'effective_from'), name='unique_model_price')],
            },
        ),
        migrations.AddField(
            model_name='dailyusage',
            name='cached_input_cost',
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name='dailyusage',
            name='input_cost',
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name='dailyusage',
            name='output_cost',
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name='usagerecord',
            name='cached_input_cost',
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name='usagerecord',
            name='input_cost',
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name='usagerecord',
            name='output_cost',
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddIndex(
            model_name='dailyusage',
            index=models.Index(fields=['team', 'date'], name='inference_d_team_id_01f4c8_idx'),
        ),
    ]
